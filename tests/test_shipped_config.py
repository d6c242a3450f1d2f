"""The configuration users run: dtype "auto" (bf16 where the CPU has bf16 instructions) and a compiled
engine (`pie serve` compiles with compile "auto") give the default model's float32 greedy answer.

Every other engine test runs float32, so a fast but wrong bf16 path, eager or compiled, would pass
them. Here the default model runs as shipped, eager and compiled, against transformers in float32.
On a host where dtype "auto" is float32 there is no bf16 path to check: the module skips, saying so.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pie_actors.config import pick_dtype
from pie_actors.gpu.engine import Engine
from pie_actors.tokenizer import Tokenizer
from tests.engine_helpers import hf_greedy
from tests.test_model_reference import PROMPTS, engine_greedy

pytestmark = pytest.mark.skipif(
    pick_dtype("auto", torch.device("cpu")) != torch.bfloat16,
    reason='dtype "auto" is float32 on this host (no AVX512-BF16 or AMX-BF16, or torch dispatches below '
           "AVX-512): the shipped bf16 path does not run here")

# The first tokens of each prompt, fed the reference's tokens (teacher forcing).
TOKENS = 8
# bf16 keeps 8 bits of mantissa, so weights and activations round by up to 2^-9 relative; over 30
# layers that adds up to at most 0.8 on logits of magnitude up to ~40 (measured here: 16 steps of
# each prompt, the engine in bf16 against transformers in float32). 1.5 leaves room for other
# hosts' bf16 kernels; a wrong graph (a misplaced position, a stale KV slot, a wrong layer) moves
# logits by tens and changes the picks.
BF16_ATOL = 1.5
# The prompts of test_model_reference, and one whose every pick leads by more than 2 * BF16_ATOL, so
# that the greedy tokens are checked at every step of it in bf16 too.
CHECKED_PROMPTS = [*PROMPTS, "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def reference(default_gguf, default_model_dir) -> dict[str, tuple[list[int], torch.Tensor]]:
    """transformers' float32 greedy tokens and logits of each prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_dir(default_model_dir)
    return {text: hf_greedy(model, tokenizer.encode(text), TOKENS) for text in CHECKED_PROMPTS}


def shipped_engine(model_dir: Path, device: str, compile: str) -> Engine:
    """The default model as shipped: dtype "auto". Compiled, one bucket (batch 1: every decode step of
    `engine_greedy`), which keeps the compile to minutes on 2 cores."""
    return Engine.from_model(str(model_dir), device=device, dtype="auto", compile=compile, compile_max_batch=1,
                             num_pages=64, progress=False)


def check_against_reference(engine: Engine, reference: dict, atol: float = BF16_ATOL, rtol: float = 0.0) -> None:
    """Fed the reference's tokens, the engine's logits are within `atol` (+ `rtol`) of the reference's
    at every step, and its greedy pick is the reference's wherever that pick leads by more than twice
    the bound (elsewhere the bound allows either pick of a near tie)."""
    clear_steps = 0
    for text, (want_tokens, want_logits) in reference.items():
        got_tokens, got_logits = engine_greedy(engine, engine.tokenizer.encode(text), TOKENS, forced=want_tokens)
        torch.testing.assert_close(got_logits.float().cpu(), want_logits, atol=atol, rtol=rtol, msg=text)
        top2 = want_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1] > 2 * (atol + rtol * top2[:, 0].abs())).tolist()
        assert [g for g, w, c in zip(got_tokens, want_tokens, clear) if c] == \
            [w for w, c in zip(want_tokens, clear) if c], text
        clear_steps += sum(clear)
    assert clear_steps >= TOKENS, "the prompts leave the greedy tokens unchecked"


def test_auto_dtype_eager_gives_the_float32_answer(default_model_dir, reference):
    engine = shipped_engine(default_model_dir, "cpu", compile="off")
    assert engine.worker.dtype == torch.bfloat16
    check_against_reference(engine, reference)


def test_auto_dtype_compiled_gives_the_float32_answer(default_model_dir, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_HOME", str(tmp_path))         # the packages compiled here go with the test
    engine = shipped_engine(default_model_dir, "cpu", compile="on")
    assert engine.worker.dtype == torch.bfloat16 and engine.worker.compiled.compiled_now == [1]
    check_against_reference(engine, reference)
    # each prompt's first token comes from an eager prefill, the others from the compiled graph
    assert engine.worker.compiled.runs == {1: len(reference) * (TOKENS - 1)}
