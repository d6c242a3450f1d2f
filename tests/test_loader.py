"""GGUF import and Hugging Face folder loading, checked against transformers and llama.cpp's conventions."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from pie_actors.gpu.model.loader import ModelLoadError, import_gguf, load_checkpoint
from pie_actors.gpu.model.config import UnsupportedModel

from tests.engine_helpers import save_tiny_model, saved_state


def test_default_model_weights_equal_transformers_gguf_loader(default_model_dir, default_gguf, monkeypatch):
    """transformers dequantizes the same GGUF and undoes the Q/K permutation its own way: every tensor
    must come out bit-identical, under the same name."""
    import functools

    import gguf
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers rebuilds this pure lookup table once per module (8 s here); memoizing changes nothing else.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))

    # AutoModelForCausalLM.from_pretrained(gguf_file=...) needs accelerate; this is the loader it calls.
    hf_config = transformers.AutoConfig.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    reference = load_gguf_checkpoint(str(default_gguf), return_tensors=True, model_to_load=skeleton)["tensors"]

    ours = dict(load_checkpoint(default_model_dir).weights())
    assert set(ours) == set(reference)
    for name, want in reference.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], torch.as_tensor(want)), name

    # The permutation is really exercised: stored rows differ from the Hugging Face order.
    raw = next(t for t in gguf.GGUFReader(default_gguf).tensors if t.name == "blk.0.attn_q.weight")
    stored = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type))
    assert not torch.equal(stored, ours["model.layers.0.self_attn.q_proj.weight"])


def test_default_model_config(default_model_dir):
    cfg = load_checkpoint(default_model_dir).config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


@pytest.mark.parametrize("arch,qtype,tied", [
    ("llama", "F32", True), ("llama", "Q8_0", False), ("llama", "BF16", True),
    ("qwen2", "F16", False), ("qwen3", "Q8_0", True)])
def test_tiny_gguf_imports_to_the_original_tensors(tiny_gguf, tmp_path, arch, qtype, tied):
    import transformers

    path, expected = tiny_gguf(arch, qtype=qtype, tied=tied)
    folder = import_gguf(path, tmp_path / "out", progress=False)
    checkpoint = load_checkpoint(folder)
    ours = dict(checkpoint.weights())
    assert set(ours) == set(expected)
    for name, want in expected.items():
        assert ours[name].dtype == want.dtype, name
        assert torch.equal(ours[name], want), name

    cfg = checkpoint.config
    assert cfg.architecture == arch and cfg.tie_word_embeddings == tied
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.head_dim == (32 if arch == "qwen3" else 16) and cfg.rms_norm_eps == 1e-6
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == (
        {"F16": "float16", "BF16": "bfloat16"}.get(qtype, "float32"))

    # transformers reads the folder as the same model: config.json is a valid Hugging Face config.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = model.state_dict()
    for name, want in expected.items():
        assert torch.equal(state[name], want.float()), name


def test_gguf_import_writes_shards_with_an_index(tiny_gguf, tmp_path):
    path, expected = tiny_gguf("llama")
    folder = import_gguf(path, tmp_path / "out", progress=False, max_shard_bytes=64 * 1024)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)
    checkpoint = load_checkpoint(folder)
    assert len(checkpoint.files) == len(shards)
    assert {k: v for k, v in checkpoint.weights()}.keys() == expected.keys()


@pytest.mark.parametrize("metadata,want", [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 32768.0},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ({"llama.rope.scaling.type": "longrope"}, UnsupportedModel),
])
def test_rope_scaling_metadata(tiny_gguf, tmp_path, metadata, want):
    path, _ = tiny_gguf("llama", metadata=metadata)
    if want is UnsupportedModel:
        with pytest.raises(UnsupportedModel, match="longrope"):
            import_gguf(path, tmp_path / "out", progress=False)
    else:
        assert load_checkpoint(import_gguf(path, tmp_path / "out", progress=False)).config.rope_scaling == want


def llama3_factors(theta: float, dim: int, factor: float) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for llama3 rope scaling (low 1, high 4, original 8192)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            out.append(1)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_factors_become_rope_scaling(tiny_gguf, tmp_path):
    factors = llama3_factors(10000.0, 16, 8.0)
    assert 1.0 in factors and 8.0 in factors and len(set(factors.tolist())) > 2  # all three regimes
    path, _ = tiny_gguf("llama", rope_freqs=factors)
    cfg = load_checkpoint(import_gguf(path, tmp_path / "out", progress=False)).config
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

    path, _ = tiny_gguf("llama", rope_freqs=np.linspace(1, 3, 8))
    with pytest.raises(UnsupportedModel, match="rope_freqs"):
        import_gguf(path, tmp_path / "out2", progress=False)


@pytest.mark.parametrize("damage", ["truncated", "header_only", "random", "empty", "missing"])
def test_corrupt_gguf_raises_model_load_error_naming_the_file(tiny_gguf, tmp_path, damage):
    good, _ = tiny_gguf("llama")
    data = good.read_bytes()
    bad = tmp_path / f"{damage}.gguf"
    if damage == "truncated":  # cut inside the tensor data
        bad.write_bytes(data[: len(data) - 1000])
    elif damage == "header_only":
        bad.write_bytes(data[:64])
    elif damage == "random":
        bad.write_bytes(np.random.default_rng(0).bytes(10_000))
    elif damage == "empty":
        bad.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=str(bad)):
        import_gguf(bad, tmp_path / "out", progress=False)


def test_unsupported_gguf_tokenizer_names_the_problem(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama", pre="tekken")
    with pytest.raises(ModelLoadError, match="tekken"):
        import_gguf(path, tmp_path / "out", progress=False)


# --- Hugging Face folders -------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_hf_folder_loads_the_saved_tensors_and_config(tmp_path, family):
    state = saved_state(save_tiny_model(family, tmp_path))
    checkpoint = load_checkpoint(tmp_path)
    ours = dict(checkpoint.weights())
    assert ours.keys() == state.keys()
    for name, want in state.items():
        assert torch.equal(ours[name], want), name
    cfg = checkpoint.config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (family, 2, 4, 2, 64 if family == "qwen3" else 16)
    assert cfg.attention_bias == (family == "qwen2")
    assert cfg.qk_norm == (family == "qwen3")
    assert not cfg.tie_word_embeddings


def test_sharded_hf_folder(tmp_path):
    state = saved_state(save_tiny_model("qwen2", tmp_path, max_shard_size="100KB"))
    checkpoint = load_checkpoint(tmp_path)
    assert len(checkpoint.files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    ours = dict(checkpoint.weights())
    assert ours.keys() == state.keys() and all(torch.equal(ours[k], v) for k, v in state.items())

    # A shard listed in the index but gone is named.
    shutil.move(checkpoint.files[-1], tmp_path / "elsewhere")
    with pytest.raises(ModelLoadError, match=checkpoint.files[-1].name):
        load_checkpoint(tmp_path)


def test_folder_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_checkpoint(tmp_path)

    save_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        load_checkpoint(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_checkpoint(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_checkpoint(tmp_path)

    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)
