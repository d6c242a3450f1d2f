"""The engine's model equals transformers: greedy tokens and logits, fp32 on the CPU."""
from __future__ import annotations

import pytest
import torch
import transformers

from pie_actors.gpu.engine import Lane, PassRequest
from tests.engine_helpers import hf_greedy, make_engine, save_tiny_model


def engine_greedy(engine, prompt: list[int], n: int, forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """One pass per token through the engine's public pass API; returns tokens and per-step logits.
    `forced`: the tokens fed after the prompt in place of the engine's picks (a reference's), so that
    every step's logits compare with the reference's even where a near tie turns a pick."""
    seq = engine.create_sequence()
    tokens, logits, feed = [], [], list(prompt)
    for step in range(n):
        fut = engine.submit(PassRequest([Lane(seq, feed)]))
        engine.run_until_idle()
        row = fut.result()[-1]
        logits.append(row)
        tokens.append(int(row.argmax()))
        feed = [tokens[-1] if forced is None else forced[step]]
    engine.free(seq)
    engine.kv.check()
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_tiny_random_models_match_transformers(family, tmp_path):
    folder = save_tiny_model(family, tmp_path / family)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    engine = make_engine(folder, page_size=8)
    g = torch.Generator().manual_seed(1)
    for length in (5, 17, 40):    # within a page, across pages, several pages
        prompt = torch.randint(0, 512, (length,), generator=g).tolist()
        want_tokens, want_logits = hf_greedy(reference, prompt, 32)
        got_tokens, got_logits = engine_greedy(engine, prompt, 32)
        assert got_tokens == want_tokens
        torch.testing.assert_close(got_logits, want_logits, atol=2e-4, rtol=1e-4)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def test_default_model_matches_transformers(default_model_dir, default_gguf):
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, torch_dtype=torch.float32).eval()
    engine = make_engine(default_model_dir)
    for text in PROMPTS:
        prompt = engine.tokenizer.encode(text)
        want_tokens, want_logits = hf_greedy(reference, prompt, 32)
        got_tokens, got_logits = engine_greedy(engine, prompt, 32)
        assert got_tokens == want_tokens, text
        torch.testing.assert_close(got_logits, want_logits, atol=2e-3, rtol=1e-3)


def test_default_model_knows_paris(default_model_dir):
    engine = make_engine(default_model_dir)
    tok = engine.tokenizer
    prompt = tok.encode(tok.chat_template.render(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True))
    reply = tok.decode(engine.generate([prompt], 48)[0], skip_special=True)
    assert "Paris" in reply, reply
