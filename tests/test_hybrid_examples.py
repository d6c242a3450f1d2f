"""The `examples/` inferlets that roll a working set back, on a hybrid model: run-ahead decoding
(its unread runs cut off when it stops) and speculative decoding (rejected drafts rewritten, from
the recurrent state kept before them) give exactly per-token greedy decoding on a small random
Qwen3.5 folder, and every page and recurrent-state slot returns."""
from __future__ import annotations

import pytest

from pie_actors import Runtime
from tests.engine_helpers import save_tiny_hybrid
from tests.inferlet_helpers import EXAMPLES, idle_stats, run
from tests.test_examples_eta import encode, greedy

PROMPTS = ("The capital of France is", "one, two, three, one, two, three, one,")
# The random model's greedy tokens after this prompt rarely repeat: with one-token drafts (n=1) one
# of its eight drafts is accepted and the rest are rejected.
DRAFTED = "no, red, the, no, red, the, no, red, the"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, default_model_dir):
    folder = save_tiny_hybrid(tmp_path_factory.mktemp("hybrid") / "tiny-qwen3_5", default_model_dir)
    with Runtime.local(str(folder), dtype="float32", num_pages=128, timeout_s=120, compile="off") as rt:
        yield rt


def _all_back(runtime: Runtime) -> None:
    stats = idle_stats(runtime)
    assert stats["kv"]["referenced"] == 0 and stats["states"]["held"] == 0, stats
    engine = runtime.engine
    with engine._lock:
        engine.kv.check()


@pytest.mark.parametrize("name", ["run_ahead", "speculative"])
def test_example_equals_greedy(runtime, name):
    engine = runtime.engine
    for prompt in PROMPTS:
        out = run(runtime, (EXAMPLES / name / "main.py").read_text(), {"prompt": prompt, "max_tokens": 24})
        assert out["tokens"] == greedy(engine, encode(engine, prompt), 24), (name, prompt)
    _all_back(runtime)


def test_speculative_drafts_are_accepted_and_rejected(runtime):
    """The speculative run above drafts: an accepted draft saves a pass, a rejected one is rewritten
    from the state kept before it, and the tokens are still greedy decoding's."""
    engine = runtime.engine
    source = (EXAMPLES / "speculative" / "main.py").read_text()
    out = run(runtime, source, {"prompt": DRAFTED, "max_tokens": 24, "n": 1})
    assert out["tokens"] == greedy(engine, encode(engine, DRAFTED), 24)
    assert 0 < out["accepted"] < out["drafted"], out
    assert out["passes"] < len(out["tokens"])
    _all_back(runtime)


# A pass appends a tail without freezing it, keeping the recurrent state where asked; the next pass
# rewrites from there (explicit slots), as a speculative program does with its rejected drafts.
ROLLBACK = """
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax


async def main(input):
    from inferlet import HostError
    ws, pipe = WorkingSet(), Pipeline()

    def step(tokens, geometry, checkpoints=None):
        fwd = ForwardPass()
        fwd.embed(tokens)
        fwd.state([ws], geometry)
        if checkpoints is not None:
            fwd.checkpoints(checkpoints)
        token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        return token

    prompt, tail = input["prompt"], input["tail"]
    await step(prompt, StateGeometry.folding())
    slot = len(prompt) + input["keep"]
    try:
        await step(tail, StateGeometry(fold=False), input["checkpoints"])
        return {"token": await step([input["again"]], StateGeometry(positions=[slot], slots=[slot],
                                                                    kv_len=slot + 1, fold=slot + 1))}
    except HostError as e:
        return {"error": str(e)}
"""


def test_fwd_checkpoints_let_a_program_rewrite_from_a_kept_state(runtime):
    """`fwd.checkpoints(slots)` from an inferlet: the rewrite from a kept slot gives the greedy token
    of the sequence left; without the checkpoint the rewrite is refused, and so is a slot outside the
    pass, each failing its own pass only."""
    engine = runtime.engine
    prompt, tail, again = encode(engine, PROMPTS[0]), [11, 12, 13, 14], 21
    case = {"prompt": prompt, "tail": tail, "again": again, "keep": 2}
    out = run(runtime, ROLLBACK, {**case, "checkpoints": [len(prompt) + 2]})
    assert out == {"token": greedy(engine, prompt + tail[:2] + [again], 1)[0]}
    refused = run(runtime, ROLLBACK, {**case, "checkpoints": None})["error"]
    assert f"not at {len(prompt) + 2}" in refused, refused
    outside = run(runtime, ROLLBACK, {**case, "checkpoints": [99]})["error"]
    assert "checkpoint slot 99 is outside the pass's slots" in outside, outside
    _all_back(runtime)
