"""Model hyper-parameters, parsed from a Hugging Face `config.json`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Hugging Face `architectures[0]` / `model_type` -> our family name. All three share one model file.
_FAMILIES = {
    "LlamaForCausalLM": "llama", "llama": "llama",
    "MistralForCausalLM": "llama", "mistral": "llama",
    "Qwen2ForCausalLM": "qwen2", "qwen2": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "qwen3": "qwen3",
}


class UnsupportedModel(ValueError):
    """The checkpoint's architecture is not one this engine implements."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                 # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False             # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        names = list(cfg.get("architectures") or []) + [cfg.get("model_type", "")]
        family = next((_FAMILIES[n] for n in names if n in _FAMILIES), None)
        if family is None:
            raise UnsupportedModel(
                f"unsupported model architecture {names!r}; supported: {sorted(set(_FAMILIES))}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", family == "qwen2"),
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
