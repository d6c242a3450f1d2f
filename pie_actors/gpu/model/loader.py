"""Model files: GGUF -> Hugging Face folder conversion, and reading Hugging Face folders.

The engine only ever loads Hugging Face style folders (config.json + safetensors + tokenizer files);
a GGUF is converted into one once, at import (`import_gguf`), so loading stays a plain mmap'd read.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .config import ModelConfig, UnsupportedModel
from ...tokenizer import tokenizer_from_gguf


class ModelLoadError(ValueError):
    """A model file or folder is missing, corrupt, or not what it claims to be."""


# --- reading Hugging Face folders ------------------------------------------------------------------

@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    config: ModelConfig
    files: tuple[Path, ...]  # the safetensors files holding the weights

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every stored tensor, read lazily one at a time."""
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


def load_checkpoint(folder: str | Path) -> Checkpoint:
    """Open a Hugging Face model folder: parse config.json and find (and header-check) its safetensors."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; not a Hugging Face model folder")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from e
    try:
        config = ModelConfig.from_hf(raw)
    except KeyError as e:
        raise ModelLoadError(f"{config_path} lacks required field {e}") from e
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{config_path}: {e}") from None

    files = _weight_files(folder)
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as e:  # safetensors raises its own SafetensorError for bad headers
            raise ModelLoadError(f"{file} is not a readable safetensors file: {e}") from e
    return Checkpoint(folder, config, files)


def _weight_files(folder: Path) -> tuple[Path, ...]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder} is missing weight shards listed in {index.name}: {missing}")
        return tuple(files)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return tuple(files)


# --- GGUF -> Hugging Face folder -------------------------------------------------------------------

# GGUF architecture -> (HF architectures[0], HF model_type)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Control tokens llama.cpp treats as end-of-generation besides the declared eos/eot/eom ids.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "_<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"}

SHARD_BYTES = 2 << 30  # bounds the memory an import holds: one shard of dequantized tensors at a time


def import_gguf(path: str | Path, out_dir: str | Path, progress: bool = True,
                max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Convert a GGUF file into a Hugging Face style folder `out_dir` (created if needed) and return it.

    Quantized tensors are dequantized to float32; F32/F16/BF16 tensors keep their dtype.
    Raises ModelLoadError for unreadable files, UnsupportedModel for architectures we do not run.
    """
    path, out_dir = Path(path), Path(out_dir)
    meta, tensors = _read_gguf(path)
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModel(f"{path}: GGUF architecture {arch!r} is not supported; "
                               f"supported: {sorted(_ARCHITECTURES)}")
    try:
        tokenizer = tokenizer_from_gguf(meta)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: cannot build its tokenizer: {e}") from e

    by_name = {t.name: t for t in tensors}
    if "token_embd.weight" not in by_name:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor; not a language model GGUF")
    config = _hf_config(path, meta, by_name)
    # rope_freqs is folded into config.json's rope_scaling; name every other tensor before the slow part.
    hf_names = {t.name: _hf_name(path, t.name) for t in tensors if t.name != "rope_freqs.weight"}
    out_dir.mkdir(parents=True, exist_ok=True)

    writer = _ShardWriter(out_dir, max_shard_bytes)
    for t in tqdm(tensors, desc=f"importing {path.name}", unit="tensor", disable=not progress):
        if t.name not in hf_names:
            continue
        hf_name = hf_names[t.name]
        w = _tensor(path, t)
        if arch == "llama" and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            heads = config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]
            w = _unpermute(w, heads)
        writer.add(hf_name, w)
    writer.close()

    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta, config))
    _write_json(out_dir / "generation_config.json", _generation_config(meta, config))
    return out_dir


def _read_gguf(path: Path) -> tuple[dict[str, Any], list[Any]]:
    import gguf  # only imports need it

    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        what = "empty" if not magic else f"bad magic {magic!r}, expected b'GGUF'"
        raise ModelLoadError(f"{path} is not a GGUF file ({what})")
    try:
        reader = gguf.GGUFReader(path)
        meta = {k: f.contents() for k, f in reader.fields.items()}
        return meta, list(reader.tensors)
    except Exception as e:  # the reader fails with ValueError, struct.error, IndexError, ... on bad bytes
        raise ModelLoadError(f"{path} is a corrupt or truncated GGUF file: {type(e).__name__}: {e}") from e


def _hf_name(path: Path, gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise UnsupportedModel(f"{path}: tensor {gguf_name!r} has no place in a llama/qwen2/qwen3 model")


def _tensor(path: Path, t: Any) -> torch.Tensor:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape = tuple(reversed([int(n) for n in t.shape]))  # GGUF lists dimensions innermost first
    try:
        if t.tensor_type in (Q.F32, Q.F16):
            return torch.from_numpy(np.array(t.data).reshape(shape))  # copy: the reader's mmap is read-only
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape))
    except NotImplementedError as e:
        raise UnsupportedModel(f"{path}: tensor {t.name} uses {t.tensor_type.name}, which cannot be dequantized"
                               ) from e
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {t.name} is corrupt: {e}") from e
    return w.to(torch.bfloat16) if t.tensor_type == Q.BF16 else w  # bf16 -> f32 -> bf16 is exact


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).contiguous()


def _f32(value: float) -> float:
    # GGUF stores float32: 1e-5 arrives as 9.99999974e-06. Keep the shortest decimal that rounds back.
    return float(str(np.float32(value)))


def _hf_config(path: Path, meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    try:
        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        config: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[arch][0]],
            "model_type": _ARCHITECTURES[arch][1],
            "vocab_size": int(tensors["token_embd.weight"].shape[1]),
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": int(get("attention.key_length", hidden // heads)),
            "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": _f32(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "hidden_act": "silu",
        }
    except TypeError as e:  # a required key is absent: int(None)
        raise ModelLoadError(f"{path}: GGUF metadata lacks a required {arch}.* hyper-parameter") from e
    rope_scaling = _rope_scaling(path, meta, arch, config, tensors.get("rope_freqs.weight"))
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{key}"])
    quantized = any(t.tensor_type.name not in ("F32", "F16", "BF16") for t in tensors.values())
    config["torch_dtype"] = "float32" if quantized else {
        "F32": "float32", "F16": "float16", "BF16": "bfloat16"}[tensors["token_embd.weight"].tensor_type.name]
    return config


def _rope_scaling(path: Path, meta: dict[str, Any], arch: str, config: dict[str, Any],
                  rope_freqs: Any) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": _f32(factor), "original_max_position_embeddings": int(original)}
    if kind != "none":
        raise UnsupportedModel(f"{path}: rope scaling {kind!r} is not supported")
    if rope_freqs is not None:
        # Llama 3.1+ GGUFs store llama3 rope scaling only as per-frequency factors; recover its parameters.
        return _llama3_rope_scaling(path, np.array(rope_freqs.data, dtype=np.float32), config)
    return None


def _llama3_rope_scaling(path: Path, stored: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    # The factors llama.cpp's convert_hf_to_gguf.py writes; every Llama 3.x uses low 1, high 4, original 8192.
    scaling = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if not np.allclose(stored, llama3_rope_factors(config["rope_theta"], config["head_dim"], scaling), rtol=1e-4):
        raise UnsupportedModel(f"{path}: rope_freqs.weight does not match llama3 rope scaling")
    return scaling


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling (as llama.cpp stores them in rope_freqs.weight)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id") if k in meta]
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3 and t in _EOG_TEXTS]
    return list(dict.fromkeys(ids))


def _token(meta: dict[str, Any], key: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{key}")
    return meta["tokenizer.ggml.tokens"][int(i)] if i is not None else None


def _tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if (token := _token(meta, key)) is not None:
            out[name] = token
    if "tokenizer.chat_template" in meta:
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


def _generation_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    eos = _eos_ids(meta)
    out: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    if "bos_token_id" in config:
        out["bos_token_id"] = config["bos_token_id"]
    return out


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class _ShardWriter:
    """Writes tensors as `model.safetensors`, or as HF-style numbered shards plus an index when they
    exceed `max_bytes`, holding at most one shard in memory."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # tensor names per written shard

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size

    def _flush(self) -> None:
        save_file(self.pending, str(self.folder / f"shard-{len(self.shards)}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        # File names carry the shard count, known only now.
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            (self.folder / f"shard-{i}.tmp").rename(self.folder / name)
            (self.folder / name).chmod(0o644)  # safetensors creates files private (0600)
        if n > 1:
            weight_map = {t: name for name, tensors in zip(names, self.shards) for t in tensors}
            _write_json(self.folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
