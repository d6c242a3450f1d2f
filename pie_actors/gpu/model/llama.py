"""The Llama family in one file: Llama 2/3, SmolLM2, Mistral-style GQA, Qwen2 (QKV bias), Qwen3 (q/k norm).

Inputs are flattened: a batch is T rows from any number of lanes, each row with its own position and KV
slot (see gpu/kernels/attention.py). Linear layers are tensor-parallel (tp.py); with one rank they are plain matmuls.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Iterable

import torch
from torch import nn

from .adapters import AdapterUse, adapt
from ..kernels.attention import AttentionMetadata, paged_attention
from .tp import (ColumnParallelLinear, Comm, MergedColumnParallelLinear, ParallelLMHead,
                  RowParallelLinear, VocabParallelEmbedding)
from .config import ModelConfig


# (site, projection input, projection output) -> output: the adapters of one layer (adapters.py)
Adapt = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations; bf16 variance loses too much.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotated dimensions (all of a head's, or its leading `rotary_dim`),
    with Llama 3.1's frequency-dependent scaling when the config asks for it."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif scaling.get("rope_type", scaling.get("type")) == "linear":
        inv = inv / scaling["factor"]
    return inv.float()


class Rotary(nn.Module):
    """cos/sin tables for every position, indexed per row (rows of one batch have unrelated positions)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(cfg))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [T, 1, D/2] for the batch, looked up once and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; rotate-half convention (the Hugging Face layout of q/k weights). With partial
    rotary (cos/sin narrower than D/2) only the leading 2 * cos.shape[-1] dimensions turn."""
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
    turned = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return turned if rot == x.shape[-1] else torch.cat((turned, x[..., rot:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm):
        super().__init__()
        tp = comm.world_size
        if cfg.num_heads % tp or cfg.num_kv_heads % tp:
            raise ValueError(f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads do not split "
                             f"over tensor-parallel size {tp}")
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim
        d = cfg.head_dim
        # With an output gate (Qwen3.5), q_proj gives each head its query and then its gate.
        self.gated = cfg.attn_output_gate
        q_size = cfg.num_heads * d * (2 if self.gated else 1)
        self.qkv_proj = MergedColumnParallelLinear(
            cfg.hidden_size, {"q": q_size, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d},
            bias=cfg.attention_bias, comm=comm)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=False, comm=comm)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, adapt: Adapt | None = None
                ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if adapt is not None:
            q, k, v = adapt("q", x, q), adapt("k", x, k), adapt("v", x, v)
        gate = None
        if self.gated:
            q, gate = q.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = paged_attention(q, k, v, kv[0], kv[1], meta)
        o = (o if gate is None else o * torch.sigmoid(gate)).flatten(1)
        out = self.o_proj(o)
        return out if adapt is None else adapt("o", o, out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm):
        super().__init__()
        n = cfg.intermediate_size
        # gate and up as two GEMMs, not one merged: compiled, silu(gate) * up then fuses into them
        # as their epilogues, one kernel less a layer (+1% to +3.5% at batch 32 on the CPU across
        # A/B runs, bench/RESULTS.md); eager, the two cost what one did
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, n, False, comm)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, n, False, comm)
        self.down_proj = RowParallelLinear(n, cfg.hidden_size, False, comm)

    def forward(self, x: torch.Tensor, adapt: Adapt | None = None) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if adapt is not None:
            gate, up = adapt("gate", x, gate), adapt("up", x, up)
        h = nn.functional.silu(gate) * up
        out = self.down_proj(h)
        return out if adapt is None else adapt("down", h, out)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, comm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, comm)

    def forward(self, x, rope, kv, meta, adapt: Adapt | None = None):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta, adapt)
        return x + self.mlp(self.post_attention_layernorm(x), adapt)


class LlamaModel(nn.Module):
    """Embedding -> blocks -> final norm. `lm_head` is applied only to the rows read out."""

    # checkpoint name fragment -> (our module fragment, shard id) for the fused projections
    packed = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    }

    def __init__(self, cfg: ModelConfig, comm: Comm | None = None):
        super().__init__()
        comm = comm or Comm()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm)
        self.layers = nn.ModuleList(self.block(cfg, comm, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, comm)
        self.rotary = Rotary(cfg)

    @staticmethod
    def block(cfg: ModelConfig, comm: Comm, i: int) -> nn.Module:
        """Layer `i` (every layer of this family is the same kind)."""
        return Block(cfg, comm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                adapters: list[AdapterUse] | None = None) -> torch.Tensor:
        """Hidden states of every row; `adapters` (fwd.adapter) change some projections of some rows."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rope, kv, meta, partial(adapt, adapters, i) if adapters else None)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model; None for tensors it does not use."""
        return None if "rotary_emb" in name else name.removeprefix("model.")

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this model's parameter `name` holds it."""
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face named tensors; each parameter's weight_loader takes its own shard."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name is None:
                continue
            tensor = self.convert(name, tensor)
            shard = None
            for src, (dst, shard_id) in self.packed.items():
                if f".{src}." in name:
                    name, shard = name.replace(f".{src}.", f".{dst}."), shard_id
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the {self.cfg.architecture} model")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            tensor = tensor.to(param.dtype)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard)
            seen.add(name)
            if name == "embed_tokens.weight" and self.cfg.tie_word_embeddings:
                self.lm_head.weight_loader(self.lm_head.weight, tensor)
                seen.add("lm_head.weight")
        missing = set(params) - seen
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:4]}")
