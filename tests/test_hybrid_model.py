"""Qwen3.5, the hybrid of gated DeltaNet and gated attention layers, against transformers.

Small random Qwen3.5 models written by transformers as Hugging Face folders go through the loading
code a user's folder goes through; the engine's logits, greedy tokens and `pie generate` text are
compared with transformers' own on the same folder. Each engine test ends with the KV pages and the
recurrent-state slots all back.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pie_actors.gpu.engine.scheduler import Lane, PassError, PassRequest
from pie_actors.gpu.model.config import UnsupportedModel
from pie_actors.gpu.model.loader import load_checkpoint
from pie_actors.kvstore import InvalidSlot
from tests.engine_helpers import hf_greedy, make_engine, save_tiny_model

PROMPTS = [[(7 * i + 3) % 512 for i in range(n)] for n in (5, 70, 1, 33)]   # 70: two delta-rule chunks


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def reference(folder):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def engine(folder):
    eng = make_engine(folder, num_pages=64)
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def accounting_holds(request):
    """Every engine test ends with the page and state accounting intact and nothing held."""
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        eng.kv.check()
        assert eng.kv.stats()["referenced"] == 0
        assert eng.kv.state_stats()["held"] == 0


def _run(engine, request: PassRequest):
    future = engine.submit(request)
    engine.run_until_idle()
    return future.result()


def test_config_describes_the_layers(folder):
    cfg = load_checkpoint(folder).config
    assert cfg.architecture == "qwen3_5"
    assert cfg.recurrent_layers == (0, 1, 2, 4, 5, 6) and cfg.kv_layers == (3, 7)
    assert cfg.rotary_dim == 16 and cfg.attn_output_gate


def test_prefill_and_decode_logits_match_transformers(engine, reference):
    for prompt in PROMPTS:
        with torch.no_grad():
            full = reference(torch.tensor([prompt])).logits[0]
        tokens, steps = hf_greedy(reference, prompt, 6)
        seq = engine.create_sequence()
        try:
            logits = _run(engine, PassRequest([Lane(seq, prompt, readout=list(range(len(prompt))))]))
            torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)       # every prefill row
            for i, token in enumerate(tokens[:-1]):                               # decode rows
                [row] = _run(engine, PassRequest([Lane(seq, [token])]))
                torch.testing.assert_close(row, steps[i + 1], rtol=1e-4, atol=1e-4)
        finally:
            engine.free(seq)


def test_greedy_tokens_batched_equal_alone_and_transformers(engine, reference):
    expected = [hf_greedy(reference, p, 12)[0] for p in PROMPTS]
    assert engine.generate(PROMPTS, 12, ignore_eos=True) == expected
    assert [engine.generate([p], 12, ignore_eos=True)[0] for p in PROMPTS] == expected


def test_mixed_prefill_and_decode_in_one_batch(engine, reference):
    """Lanes decoding and lanes prefilling share batches: each gets its tokens from alone."""
    expected = [hf_greedy(reference, p, 4)[0] for p in PROMPTS]
    seqs = [engine.create_sequence() for _ in PROMPTS]
    greedy = lambda logits: logits.argmax(-1).tolist()
    out: list[list[int]] = [[] for _ in PROMPTS]
    try:
        for step in range(len(PROMPTS) + 3):   # prompt i starts at step i, while the earlier ones decode
            live = [i for i in range(len(PROMPTS)) if i <= step and len(out[i]) < 4]
            lanes = [Lane(seqs[i], out[i][-1:] or PROMPTS[i]) for i in live]
            for i, token in zip(live, _run(engine, PassRequest(lanes, greedy))):
                out[i].append(token)
    finally:
        for seq in seqs:
            engine.free(seq)
    assert out == expected


def test_a_pass_failing_after_the_model_ran_leaves_the_state_as_it_was(engine, reference):
    prompt = PROMPTS[1]
    expected = hf_greedy(reference, prompt, 5)[0]
    seq = engine.create_sequence()

    def fail(logits):
        raise RuntimeError("epilogue failed")

    try:
        first = _run(engine, PassRequest([Lane(seq, prompt)], lambda l: int(l[0].argmax())))
        held = engine.kv.state_stats()["held"]
        with pytest.raises(RuntimeError, match="epilogue failed"):
            _run(engine, PassRequest([Lane(seq, [first])], fail))          # ran the model, then failed
        assert engine.kv.length(seq) == len(prompt) and engine.kv.state_stats()["held"] == held
        engine.kv.check()
        out = [first]
        for _ in range(4):
            out.append(_run(engine, PassRequest([Lane(seq, [out[-1]])], lambda l: int(l[0].argmax()))))
    finally:
        engine.free(seq)
    assert out == expected


def test_passes_the_recurrent_state_cannot_serve_fail_alone(engine, reference):
    seq, other = engine.create_sequence(), engine.create_sequence()
    try:
        _run(engine, PassRequest([Lane(seq, PROMPTS[0])]))
        engine.reserve(seq, 16)
        with pytest.raises(InvalidSlot, match="only in order"):
            _run(engine, PassRequest([Lane(seq, [1, 2], slots=[5, 7])]))
        with pytest.raises(InvalidSlot, match="slot 2 is frozen"):
            _run(engine, PassRequest([Lane(seq, [1, 2], slots=[2, 3])]))
        with pytest.raises(PassError, match="mask"):
            _run(engine, PassRequest([Lane(seq, [1], mask=[[True] * 6])]))
        with pytest.raises(InvalidSlot, match="kept at 5 rows and at \\[\\], not at 2"):
            engine.kv.cut(seq, 2)
        # the sequence goes on as if none of that was asked, and another was never touched
        tokens = [int(_run(engine, PassRequest([Lane(seq, [1, 2])]))[0].argmax())]
        assert tokens == hf_greedy(reference, PROMPTS[0] + [1, 2], 1)[0]
        assert _run(engine, PassRequest([Lane(other, PROMPTS[2])]))[0].argmax() == \
            hf_greedy(reference, PROMPTS[2], 1)[0][0]
    finally:
        engine.free(seq)
        engine.free(other)


def test_image_text_folder_loads_its_text_model(tmp_path):
    import transformers
    folder = save_tiny_model("qwen3_5_vl", tmp_path / "vl")
    reference = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    assert load_checkpoint(folder).config.architecture == "qwen3_5"
    engine = make_engine(folder, num_pages=32)
    try:
        expected = [hf_greedy(reference, p, 8)[0] for p in PROMPTS[:2]]
        assert engine.generate(PROMPTS[:2], 8, ignore_eos=True) == expected
        engine.kv.check()
        assert engine.kv.state_stats()["held"] == 0
    finally:
        engine.close()


def test_unknown_layer_type_and_missing_tensor_are_named(tmp_path, folder):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"][2] = "sliding_mamba"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="sliding_mamba"):
        load_checkpoint(bad)

    from safetensors.torch import load_file, save_file
    (bad / "config.json").write_bytes((folder / "config.json").read_bytes())
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.5.linear_attn.A_log"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(KeyError, match=r"layers\.5\.linear_attn\.A_log"):
        make_engine(bad, num_pages=8)


def test_pie_generate_gives_transformers_greedy_text(tmp_path, default_model_dir):
    """`pie model import FOLDER`, then `pie generate` on it, as a user with a downloaded folder would."""
    import transformers
    from pie_actors.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    src = save_tiny_model("qwen3_5", tmp_path / "Tiny-Qwen3.5", vocab_size=tok.vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((default_model_dir / name).read_bytes())
    pie = Path(sys.executable).parent / "pie"
    env = dict(os.environ, PIE_HOME=str(tmp_path / "home"))
    imported = subprocess.run([str(pie), "model", "import", str(src)], capture_output=True, text=True,
                              timeout=300, env=env)
    assert imported.returncode == 0, imported.stderr
    prompt = "The capital of France is"
    out = subprocess.run([str(pie), "generate", "--model", "tiny-qwen3.5", "--dtype", "float32", "--compile", "off",
                          "--max-tokens", "16", "--prompt", prompt], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr

    reference = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    tokens, _ = hf_greedy(reference, tok.encode(prompt), 16)
    streamed, shown = "", ""                   # what pie generate prints: each decode's new text
    for n in range(1, len(tokens) + 1):
        decoded = tok.decode(tokens[:n], skip_special=True)
        streamed, shown = streamed + decoded[len(shown):], decoded
    assert out.stdout == streamed + "\n"
