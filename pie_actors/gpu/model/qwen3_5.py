"""Qwen3.5's text model: a hybrid of gated DeltaNet (linear attention) layers and gated full-attention layers.

The config's `layer_types` says which layer is which (three DeltaNet layers, then one attention layer,
repeated). The attention layers are llama.py's (q/k norm, partial rotary, an output gate) over the
paged KV; the MLP, norms and rotary tables are llama.py's too. A DeltaNet layer keeps, per working
set, a fixed-size recurrent state instead of KV: the last `kernel - 1` inputs of its short causal
convolution and the delta rule's [value heads, key dim, value dim] matrix.

Those states live in one tensor pair per DeltaNet layer, indexed by state slot (the KV store hands
slots out, kvstore/states.py). Each lane of a batch reads its state from one slot and writes the
state after its rows into another (`RecurrentMetadata`), so a pass that fails leaves the state it
read as it was; where the store asks, it also writes the states after some of its rows (checkpoints
for a rollback, snapshots at page boundaries for prefix reuse). The last slot holds zeros: the state of an empty working set. Prefill runs the
chunked form of the gated delta rule, one lane at a time; decode lanes run the recurrent step
together.

Qwen3.5's RMSNorms scale by (1 + weight); loading adds the 1 to those weights, so llama.py's RMSNorm
serves them (the gated norm after the delta rule scales by its weight as stored).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.attention import AttentionMetadata, LanePlan
from .adapters import AdapterUse, adapt
from .config import LINEAR_ATTENTION, ModelConfig
from .llama import MLP, Adapt, Attention, LlamaModel, RMSNorm
from .tp import ColumnParallelLinear, Comm

CHUNK = 64                                 # rows per chunk of the chunked delta rule


@dataclass
class _Prefill:
    start: int
    src: int
    segments: list[tuple[int, int]]      # (end row, slot its state is written to), in order


@dataclass
class RecurrentMetadata:
    """Where each lane's rows are and which state slots it reads and writes, built once per batch
    and used by every DeltaNet layer. Decode lanes (one row) are served together."""

    decode_rows: torch.Tensor | None = None    # [B] rows of the one-row lanes
    decode_src: torch.Tensor | None = None     # [B] slots they read
    decode_dst: torch.Tensor | None = None     # [B] slots they write
    prefills: list[_Prefill] = field(default_factory=list)

    @classmethod
    def build(cls, lanes: list[LanePlan], states: list[tuple[int, int, list[tuple[int, int]]]],
              device: torch.device) -> "RecurrentMetadata":
        """`states[i]`: lane i's (slot read, slot written after its rows, [(rows, slot)] for the
        states it keeps after its first `rows` rows)."""
        meta = cls()
        decode = [(lane.q_start, src, dst) for lane, (src, dst, _) in zip(lanes, states) if lane.q_len == 1]
        if decode:
            rows, src, dst = (torch.tensor(col, dtype=torch.long, device=device) for col in zip(*decode))
            meta.decode_rows, meta.decode_src, meta.decode_dst = rows, src, dst
        meta.prefills = [_Prefill(lane.q_start, src,
                                  [(lane.q_start + n, slot) for n, slot in saves] + [(lane.q_start + lane.q_len, dst)])
                         for lane, (src, dst, saves) in zip(lanes, states) if lane.q_len > 1]
        return meta


def recurrent_state(cfg: ModelConfig, slots: int, device: torch.device, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One DeltaNet layer's states for `slots` working sets plus the zero slot: the convolution's
    last inputs [slots + 1, channels, kernel - 1] (model dtype) and the delta rule's matrices
    [slots + 1, value heads, key dim, value dim] (float32, as the reference keeps them)."""
    conv = torch.zeros(slots + 1, _conv_channels(cfg), cfg.linear_conv_kernel - 1, dtype=dtype, device=device)
    ssm = torch.zeros(slots + 1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                      dtype=torch.float32, device=device)
    return conv, ssm


def recurrent_state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one working set's recurrent state, over all DeltaNet layers."""
    conv = _conv_channels(cfg) * (cfg.linear_conv_kernel - 1) * dtype.itemsize
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(cfg.recurrent_layers) * (conv + ssm)


def _conv_channels(cfg: ModelConfig) -> int:
    """q, k and v side by side: what the short convolution runs over."""
    keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return 2 * keys + cfg.linear_num_value_heads * cfg.linear_value_head_dim


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of each of B lanes: q/k [B, H, Dk], v [B, H, Dv], g/beta [B, H], state [B, H, Dk, Dv]
    (all float32) -> output [B, H, Dv] and the new state. The state decays by exp(g), then is
    corrected towards v at k by beta (the delta rule), then read at q."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k.unsqueeze(-1)).sum(-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(-2), state


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of one lane at once: q/k [H, L, Dk], v [H, L, Dv], g/beta [H, L], state [H, Dk, Dv]
    (float32) -> output [H, L, Dv] and the state after the last row. Equal to L `delta_rule_step`s.

    Within a chunk of C rows, the C delta-rule updates are one triangular solve (the UT transform:
    the value each row writes, less what the earlier rows of the chunk already wrote there), so the
    sequential part is one matrix update per chunk, not one per row."""
    h, length, dk = k.shape
    pad = -length % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // CHUNK
    q, k, v = (x.view(h, chunks, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.view(h, chunks, CHUNK), beta.view(h, chunks, CHUNK)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    decay = g.cumsum(-1)                                              # log decay from the chunk's start
    future = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair_decay                  # [H, N, C, C], unit lower triangular
    values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(ut, k_beta * decay.exp().unsqueeze(-1), upper=False,
                                              unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * pair_decay                   # causal attention inside a chunk
    q_read = q * decay.exp().unsqueeze(-1)                            # q reading the state at the chunk's start
    k_write = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)       # k's write, decayed to the chunk's end
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(chunks):
        v_new = values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q_read[:, i] @ state + within[:, i] @ v_new
        state = state * chunk_decay[:, i] + k_write[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, -1, v.shape[-1])[:, :length], state


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, then times silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule, after a short causal convolution of q, k and v."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if self.hv % self.hk:
            raise ValueError(f"{self.hv} value heads are not a multiple of {self.hk} key heads")
        channels = _conv_channels(cfg)
        # single-rank layers (hybrid models run without tensor parallelism), for `linear`'s CPU kernel
        self.in_proj_qkv = ColumnParallelLinear(cfg.hidden_size, channels, False, Comm())
        self.in_proj_z = ColumnParallelLinear(cfg.hidden_size, self.hv * self.dv, False, Comm())
        self.in_proj_b = ColumnParallelLinear(cfg.hidden_size, self.hv, False, Comm())
        self.in_proj_a = ColumnParallelLinear(cfg.hidden_size, self.hv, False, Comm())
        self.conv1d = nn.Module()         # the checkpoint's depthwise Conv1d: only its weight is used
        self.conv1d.weight = nn.Parameter(torch.zeros(channels, 1, cfg.linear_conv_kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = ColumnParallelLinear(self.hv * self.dv, cfg.hidden_size, False, Comm())

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: RecurrentMetadata
                ) -> torch.Tensor:
        conv_state, ssm_state = state
        mixed = self.in_proj_qkv(x)                                    # [T, channels]
        beta = self.in_proj_b(x).float().sigmoid()                     # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        weight = self.conv1d.weight[:, 0]                              # [channels, kernel]
        out = torch.empty(x.shape[0], self.hv, self.dv, dtype=torch.float32, device=x.device)
        if meta.decode_rows is not None:
            rows, src, dst = meta.decode_rows, meta.decode_src, meta.decode_dst
            window = torch.cat((conv_state[src], mixed[rows].unsqueeze(-1)), dim=-1)   # [B, channels, kernel]
            conv_state[dst] = window[..., 1:]
            q, k, v = self._heads(F.silu((window * weight).sum(-1)))
            o, ssm_state[dst] = delta_rule_step(q, k, v, g[rows], beta[rows], ssm_state[src])
            out[rows] = o
        for p in meta.prefills:           # segment by segment: each ends in a state it keeps
            src, start = p.src, p.start
            for end, dst in p.segments:
                inputs = torch.cat((conv_state[src], mixed[start:end].T), dim=-1)     # [channels, K - 1 + L]
                conv_state[dst] = inputs[:, inputs.shape[1] - conv_state.shape[-1]:]
                convolved = F.conv1d(inputs.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]
                q, k, v = (t.transpose(0, 1) for t in self._heads(F.silu(convolved.T)))  # [H, L, D]
                rows = slice(start, end)
                o, ssm_state[dst] = delta_rule_chunked(q, k, v, g[rows].T, beta[rows].T, ssm_state[src])
                out[rows] = o.transpose(0, 1)
                src, start = dst, end
        z = self.in_proj_z(x).view(-1, self.hv, self.dv)
        return self.out_proj(self.norm(out.to(x.dtype), z).flatten(1))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved rows [R, channels] -> float32 q, k [R, Hv, Dk] (l2-normalised, q scaled, each
        key head serving Hv / Hk value heads) and v [R, Hv, Dv]."""
        q, k, v = mixed.float().split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q, k = (_l2norm(t.view(-1, self.hk, self.dk)).repeat_interleave(self.hv // self.hk, dim=1) for t in (q, k))
        return q * self.dk ** -0.5, k, v.view(-1, self.hv, self.dv)


class HybridBlock(nn.Module):
    """A pre-norm residual block whose token mixer is a DeltaNet layer or an attention layer."""

    def __init__(self, cfg: ModelConfig, comm: Comm, i: int):
        super().__init__()
        self.recurrent = cfg.layer_type(i) == LINEAR_ATTENTION
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg, comm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, comm)

    def forward(self, x, rope, cache, meta: AttentionMetadata, recurrent: RecurrentMetadata | None,
                adapt: Adapt | None = None):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, cache, recurrent) if self.recurrent else self.self_attn(h, rope, cache, meta, adapt)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), adapt)


class Qwen3_5Model(LlamaModel):
    """Embedding -> hybrid blocks -> final norm; `caches[i]` is layer i's (K, V) or recurrent state."""

    def __init__(self, cfg: ModelConfig, comm: Comm | None = None):
        if comm is not None and comm.world_size > 1:
            raise ValueError("qwen3_5 runs at tensor-parallel size 1")
        super().__init__(cfg, comm)

    @staticmethod
    def block(cfg: ModelConfig, comm: Comm, i: int) -> nn.Module:
        return HybridBlock(cfg, comm, i)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, adapters: list[AdapterUse] | None = None,
                recurrent: RecurrentMetadata | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x = layer(x, rope, cache, meta, recurrent, partial(adapt, adapters, i) if adapters else None)
        return self.norm(x)

    def checkpoint_name(self, name: str) -> str | None:
        # An image-text folder holds the text model under model.language_model, next to the vision
        # tower (model.visual) and the multi-token-prediction head (mtp), which text decoding skips.
        if name.startswith(("model.visual.", "mtp.")):
            return None
        return super().checkpoint_name(name.replace("model.language_model.", "model.", 1))

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        zero_centered = name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")
        return tensor.float() + 1.0 if zero_centered else tensor
