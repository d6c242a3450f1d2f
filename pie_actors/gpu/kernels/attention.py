"""Paged attention over a flat KV slot array.

The KV cache of one layer is a tensor [kv_heads, num_slots, head_dim] where slot = page * page_size + offset
(head-major: a gather along slots comes out in the [heads, rows, dim] layout attention multiplies with).
A batch mixes lanes of any length. Single-row lanes without a custom mask (decode) are served
together by a kernel that reads their pages in place (C++ on the CPU, Triton on CUDA); where the C++
kernel cannot be built, their pages are gathered into one padded tensor for torch ops. Longer lanes
(prefill, drafts) get one SDPA call each. The page tables, gather indices and masks are built once
per batch (`AttentionMetadata.build`) and reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import cpu_kernels

try:                                      # Triton ships with CUDA builds of torch
    from .triton_attention import paged_decode_attention
except ImportError:
    paged_decode_attention = None


@dataclass
class LanePlan:
    """One lane of a batch, as rank 0 plans it. Plain ints and lists so it pickles cheaply."""

    q_start: int                          # first row of the lane in the flattened batch
    q_len: int
    pages: list[int]                      # page table covering local slots [0, kv_len)
    kv_len: int                           # local slots the lane attends over
    q_slots: list[int] | None = None      # local slot of each row; None: the last q_len slots
    mask: list[list[bool]] | None = None  # custom [q_len, kv_len] attention mask, True = attend


@dataclass
class _Group:
    """Decode lanes batched together: rows [B], page table [B, P] and attended slots [B] (the
    paged kernels read those), and for the torch forms the same as a gather index [B, S] and mask
    [B, 1, 1, S] (None in the "kernel" form). `whole_batch`: the lanes are the batch's rows in
    order (a decode step), so their queries and outputs need no gather and scatter."""

    rows: torch.Tensor
    pages: torch.Tensor
    lengths: torch.Tensor
    index: torch.Tensor | None
    mask: torch.Tensor | None
    whole_batch: bool = False


@dataclass
class _Single:
    start: int
    end: int
    index: torch.Tensor                   # [kv_len] global slots
    mask: torch.Tensor | None             # [q_len, kv_len] bool; None = plain causal from slot 0


@dataclass
class AttentionMetadata:
    write_slots: torch.Tensor             # [T] global slot each row's K/V is written to
    page_size: int
    decode: _Group | None = None
    singles: list[_Single] = field(default_factory=list)
    # How CPU decode attention is computed: "kernel" (cpu_kernels.py), or a torch form of
    # `_decode_attention`, which compiled_decode.py may pick for inductor to fuse.
    decode_form: str = "matmul"

    @classmethod
    def build(cls, lanes: list[LanePlan], write_slots: list[int], page_size: int,
              device: torch.device, decode_form: str = "matmul") -> "AttentionMetadata":
        """Gather indices and masks for a batch, built once and used by every layer."""
        meta = cls(torch.tensor(write_slots, dtype=torch.long, device=device), page_size,
                   decode_form=decode_form)
        offsets = torch.arange(page_size, device=device)
        decode = [l for l in lanes if l.q_len == 1 and l.mask is None]
        if decode:
            max_pages = max(len(l.pages) for l in decode)
            pages = torch.tensor([l.pages + [0] * (max_pages - len(l.pages)) for l in decode],
                                 dtype=torch.long, device=device)
            # a row attends slots up to its own (causal), within kv_len
            lengths = torch.tensor([min(l.kv_len, l.q_slots[0] + 1 if l.q_slots else l.kv_len)
                                    for l in decode], dtype=torch.int32, device=device)
            rows = torch.tensor([l.q_start for l in decode], dtype=torch.long, device=device)
            whole = len(decode) == len(lanes) and all(l.q_start == i for i, l in enumerate(decode))
            meta.decode = _Group(rows, pages, lengths, None, None, whole)
            if decode_form != "kernel":
                index = (pages.unsqueeze(-1) * page_size + offsets).flatten(1)        # [B, S]
                mask = torch.arange(index.shape[1], device=device) < lengths.unsqueeze(1)
                meta.decode.index, meta.decode.mask = index, mask[:, None, None, :]
        for l in lanes:
            if l.q_len == 1 and l.mask is None:
                continue
            pages = torch.tensor(l.pages, dtype=torch.long, device=device)
            index = (pages.unsqueeze(-1) * page_size + offsets).flatten()[: l.kv_len]
            meta.singles.append(_Single(l.q_start, l.q_start + l.q_len, index, _lane_mask(l, device)))
        return meta


def _lane_mask(lane: LanePlan, device: torch.device) -> torch.Tensor | None:
    if lane.mask is not None:
        return torch.tensor(lane.mask, dtype=torch.bool, device=device)
    if lane.q_slots is None and lane.q_len == lane.kv_len:
        return None                       # rows are slots 0..n-1: SDPA's own causal path
    q_slots = (torch.tensor(lane.q_slots, device=device) if lane.q_slots is not None
               else torch.arange(lane.kv_len - lane.q_len, lane.kv_len, device=device))
    return torch.arange(lane.kv_len, device=device).unsqueeze(0) <= q_slots.unsqueeze(1)


def _gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache [H, slots, D], index [...] -> [H, ..., D].
    index_select, not cache[:, index]: advanced indexing takes a slow path on the CPU (~1 ms vs ~3 us here)."""
    return cache.index_select(1, index.flatten()).view(cache.shape[0], *index.shape, cache.shape[-1])


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      form: str = "matmul") -> torch.Tensor:
    """One query row per lane: q [B, Hq, D], k/v [Hkv, B, S, D], mask [B, 1, 1, S] -> [B, Hq, D].

    "matmul": two batched matmuls (over Hkv x B, on the gathered K/V as they are: no copy) and a
    softmax, instead of SDPA, whose flash kernel has ~70 us of fixed cost a layer for one query row.
    "fused_scores" / "fused": the scores / also P·V as broadcast multiply-sums, for inductor to
    fuse (see `AttentionMetadata.decode_form`)."""
    b, hq, d = q.shape
    hkv = k.shape[0]
    qg = q.view(b, hkv, hq // hkv, d).transpose(0, 1)                       # [Hkv, B, G, D]
    if form == "matmul":
        scores = torch.matmul(qg, k.transpose(-1, -2)).float()
    else:
        scores = (qg.float().unsqueeze(-2) * k.unsqueeze(2).float()).sum(-1)  # [Hkv, B, G, S]
    probs = (scores * d ** -0.5).masked_fill(~mask.view(1, b, 1, -1), float("-inf")).softmax(-1)
    if form == "fused":
        o = (probs.unsqueeze(-1) * v.unsqueeze(2).float()).sum(-2).to(v.dtype)   # [Hkv, B, G, D]
    else:
        o = torch.matmul(probs.to(v.dtype), v)
    return o.transpose(0, 1).reshape(b, hq, d)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the batch rows; returns [T, Hq, D].

    Writes this batch's K/V into the cache first, so a lane attends to its own new rows too.
    """
    k_cache[:, meta.write_slots] = k.transpose(0, 1)    # index_put: stays in place when compiled
    v_cache[:, meta.write_slots] = v.transpose(0, 1)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    if meta.decode is not None:
        g = meta.decode
        qd = q if g.whole_batch else q.index_select(0, g.rows)
        if q.is_cuda and paged_decode_attention is not None:
            o = paged_decode_attention(qd, k_cache, v_cache, g.pages, g.lengths, page_size=meta.page_size)
        elif meta.decode_form == "kernel":
            o = cpu_kernels.paged_decode_attention(qd, k_cache, v_cache, g.pages, g.lengths, meta.page_size)
        else:
            o = _decode_attention(qd, _gather(k_cache, g.index), _gather(v_cache, g.index), g.mask,
                                  meta.decode_form)
        if g.whole_batch:
            return o                      # a decode step: `out` is unused (dropped when compiled)
        out.index_copy_(0, g.rows, o)
    for s in meta.singles:
        # Batched 4-D inputs: CPU SDPA takes its flash kernel only for those (3-D: the math path, 3x slower).
        qs = q[s.start:s.end].transpose(0, 1).unsqueeze(0)                 # [1, Hq, L, D]
        ks = _gather(k_cache, s.index).unsqueeze(0)                        # [1, Hkv, S, D]
        vs = _gather(v_cache, s.index).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, is_causal=s.mask is None,
                                           enable_gqa=gqa)[0]
        out[s.start:s.end] = o.transpose(0, 1)
    return out
