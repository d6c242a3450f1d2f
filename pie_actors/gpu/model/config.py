"""Model hyper-parameters, parsed from a Hugging Face `config.json`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Hugging Face `architectures[0]` / `model_type` -> our family name. llama / qwen2 / qwen3 share one
# model file (llama.py); qwen3_5, the hybrid of gated DeltaNet and gated attention layers, has its own.
_FAMILIES = {
    "LlamaForCausalLM": "llama", "llama": "llama",
    "MistralForCausalLM": "llama", "mistral": "llama",
    "Qwen2ForCausalLM": "qwen2", "qwen2": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "qwen3": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5", "qwen3_5_text": "qwen3_5",
    # the image-text model: its text part (config.json's text_config, the language_model.* tensors)
    "Qwen3_5ForConditionalGeneration": "qwen3_5", "qwen3_5": "qwen3_5",
}

# The layer kinds a config's `layer_types` may name, and the state each keeps per working set.
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)


class UnsupportedModel(ValueError):
    """The checkpoint's architecture is not one this engine implements."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                 # "llama" | "qwen2" | "qwen3" | "qwen3_5"
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
    # Hybrids (qwen3_5): the kind of each layer; empty means every layer is full attention
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0  # the leading share of each head's dimensions that rotary turns
    attn_output_gate: bool = False    # q_proj also yields a gate: attention output * sigmoid(gate)
    linear_conv_kernel: int = 0       # gated DeltaNet layers: the short causal convolution's width,
    linear_num_key_heads: int = 0     # ... their query/key heads and value heads,
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0      # ... and the head sizes
    linear_value_head_dim: int = 0

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL_ATTENTION

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep paged KV (attention)."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == FULL_ATTENTION)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that keep a fixed-size recurrent state per working set (linear attention)."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == LINEAR_ATTENTION)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        names = list(cfg.get("architectures") or []) + [cfg.get("model_type", "")]
        family = next((_FAMILIES[n] for n in names if n in _FAMILIES), None)
        if family is None:
            raise UnsupportedModel(
                f"unsupported model architecture {names!r}; supported: {sorted(set(_FAMILIES))}")
        if family == "qwen3_5":
            return cls._from_qwen3_5(cfg)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
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
            eos_token_ids=_ids(cfg.get("eos_token_id")),
        )

    @classmethod
    def _from_qwen3_5(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Qwen3.5's text model; an image-text folder nests it under `text_config`, whose token ids and
        tied embeddings the outer config may give instead."""
        text = {**{k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in cfg},
                **cfg.get("text_config", cfg)}
        n = text["num_hidden_layers"]
        layer_types = tuple(text.get("layer_types") or (
            FULL_ATTENTION if (i + 1) % text.get("full_attention_interval", 4) == 0 else LINEAR_ATTENTION
            for i in range(n)))
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise UnsupportedModel(f"unknown layer type {unknown[0]!r} in layer_types; supported: {list(LAYER_TYPES)}")
        if len(layer_types) != n:
            raise UnsupportedModel(f"layer_types names {len(layer_types)} layers, num_hidden_layers is {n}")
        rope = text.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedModel(f"rope type {rope['rope_type']!r} is not supported for qwen3_5")
        heads = text["num_attention_heads"]
        return cls(
            architecture="qwen3_5",
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=n,
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            tie_word_embeddings=text.get("tie_word_embeddings", False),
            attention_bias=text.get("attention_bias", False),
            qk_norm=True,
            bos_token_id=text.get("bos_token_id"),
            eos_token_ids=_ids(text.get("eos_token_id")),
            layer_types=layer_types,
            partial_rotary_factor=rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)),
            attn_output_gate=True,
            linear_conv_kernel=text.get("linear_conv_kernel_dim", 4),
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
        )


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))
