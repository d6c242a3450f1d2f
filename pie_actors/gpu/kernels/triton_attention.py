"""Paged decode attention in Triton, for CUDA.

One program per (lane, KV head) walks the lane's page table, reading K and V straight from the page
tensors (no gathered copy) with an online softmax, and serves every query head of the KV head's GQA
group. On the CPU, csrc/paged_decode.cpp does the same (cpu_kernels.py). The kernel is checked
against that path on small shapes with Triton's interpreter (TRITON_INTERPRET=1) in the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, pages_ptr, lens_ptr, scale,
                         stride_q_row, stride_q_head, stride_kv_slot, stride_kv_head, stride_pages,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE: tl.constexpr):
    lane = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + lane)                     # slots [0, length) are attended
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    in_group = g < GROUP
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + lane * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
                mask=in_group[:, None], other=0.0).to(tl.float32)          # [G, D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    offsets = tl.arange(0, PAGE)
    for p in range(0, tl.cdiv(length, PAGE)):
        page = tl.load(pages_ptr + lane * stride_pages + p)
        valid = p * PAGE + offsets < length
        kv = (page * PAGE + offsets)[:, None] * stride_kv_slot + kv_head * stride_kv_head + d[None, :]
        k = tl.load(k_ptr + kv, mask=valid[:, None], other=0.0).to(tl.float32)   # [PAGE, D]
        v = tl.load(v_ptr + kv, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale              # [G, PAGE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p_ = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p_, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p_[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / total[:, None]
    tl.store(out_ptr + lane * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           pages: torch.Tensor, lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """q [B, Hq, D]; caches [Hkv, slots, D]; pages [B, P] page table; lengths [B] slots attended.

    Returns [B, Hq, D]. Head dim and page size must be powers of two (Triton block shapes)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[0]
    group = hq // hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    # wrap_triton: torch.export traces the launch into the graph (compiled_decode.py) instead of running it
    torch.library.wrap_triton(_paged_decode_kernel)[(b, hkv)](
        q, k_cache, v_cache, out, pages, lengths, d ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(0), pages.stride(0),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=d, PAGE=page_size)
    return out
