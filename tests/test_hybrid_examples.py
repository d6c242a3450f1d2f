"""The `examples/` inferlets that roll a working set back, on a hybrid model: run-ahead decoding
(its unread runs cut off when it stops) and speculative decoding (rejected drafts rewritten) give
exactly per-token greedy decoding on a small random Qwen3.5 folder, and every page and recurrent-state
slot returns."""
from __future__ import annotations

import pytest

from pie_actors import Runtime
from tests.engine_helpers import save_tiny_model
from tests.inferlet_helpers import EXAMPLES, idle_stats, run
from tests.test_examples_eta import encode, greedy

PROMPTS = ("The capital of France is", "one, two, three, one, two, three, one,")


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, default_model_dir):
    from pie_actors.tokenizer import Tokenizer
    folder = tmp_path_factory.mktemp("hybrid") / "tiny-qwen3_5"
    save_tiny_model("qwen3_5", folder, vocab_size=Tokenizer.from_dir(default_model_dir).vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((default_model_dir / name).read_bytes())
    with Runtime.local(str(folder), dtype="float32", num_pages=128, timeout_s=120, compile="off") as rt:
        yield rt


def _all_back(runtime: Runtime) -> None:
    assert idle_stats(runtime)["kv"]["referenced"] == 0
    engine = runtime.engine
    with engine._lock:
        engine.kv.check()
        assert engine.kv.state_stats()["held"] == 0


@pytest.mark.parametrize("name", ["run_ahead", "speculative"])
def test_example_equals_greedy(runtime, name):
    engine = runtime.engine
    for prompt in PROMPTS:
        out = run(runtime, (EXAMPLES / name / "main.py").read_text(), {"prompt": prompt, "max_tokens": 24})
        assert out["tokens"] == greedy(engine, encode(engine, prompt), 24), (name, prompt)
    _all_back(runtime)
