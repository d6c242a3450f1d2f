"""The C++ paged decode kernel (pie_actors/gpu/csrc) equals the torch gather path and rejects bad shapes;
KV tensors sit on huge pages."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pie_actors.gpu import cpu_attention
from pie_actors.gpu.attention import AttentionMetadata, LanePlan, _decode_attention, _gather
from pie_actors.gpu.worker import kv_tensor

PAGE = 16
LANES = [LanePlan(0, 1, [5, 2, 9], 40),             # partial last page
         LanePlan(1, 1, [7], 1),                    # a single slot
         LanePlan(2, 1, [3, 4, 8, 1], 64),          # full pages
         LanePlan(3, 1, [6, 10], 32, q_slots=[20]),  # explicit slot: attends slots 0..20 only
         LanePlan(4, 1, [0, 11, 12, 13, 14, 15, 16, 17, 18, 19], 150)]


def setup_module():
    assert cpu_attention.load(), "the kernel did not build (see the warning logged)"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("head_dim", cpu_attention.HEAD_DIMS)
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (9, 3), (8, 2)])
def test_kernel_matches_gather_path(dtype, tol, head_dim, q_heads, kv_heads):
    g = torch.Generator().manual_seed(head_dim + q_heads)
    pool = 24
    k = torch.randn(kv_heads, pool * PAGE, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, pool * PAGE, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata.build(LANES, list(range(len(LANES))), PAGE, torch.device("cpu"))
    q = torch.randn(len(LANES), q_heads, head_dim, generator=g).to(dtype)
    got = cpu_attention.paged_decode_attention(q, k, v, meta.decode.pages, meta.decode.lengths, PAGE)
    assert got.dtype == dtype and got.shape == q.shape
    want = _decode_attention(q.float(), _gather(k, meta.decode.index).float(),
                             _gather(v, meta.decode.index).float(), meta.decode.mask)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_kernel_under_torch_compile():
    """The op traces as one opaque call (its fake gives the output shape) and gives the same result."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 24 * PAGE, 64, generator=g)
    meta = AttentionMetadata.build(LANES, list(range(len(LANES))), PAGE, torch.device("cpu"))
    q = torch.randn(len(LANES), 6, 64, generator=g)
    args = (q, k, v, meta.decode.pages, meta.decode.lengths, PAGE)
    compiled = torch.compile(cpu_attention.paged_decode_attention, fullgraph=True)
    torch.testing.assert_close(compiled(*args), cpu_attention.paged_decode_attention(*args))


def test_kernel_rejects_bad_input():
    k = v = torch.zeros(2, 4 * PAGE, 80)
    pages, lengths = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head_dim 80"):
        cpu_attention.paged_decode_attention(torch.zeros(1, 2, 80), k, v, pages, lengths, PAGE)
    k = v = torch.zeros(2, 4 * PAGE, 64)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        cpu_attention.paged_decode_attention(torch.zeros(1, 3, 64), k, v, pages, lengths, PAGE)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_attention.paged_decode_attention(torch.zeros(1, 2, 64, dtype=torch.bfloat16), k, v, pages, lengths, PAGE)
    with pytest.raises(RuntimeError, match="lengths int32"):
        cpu_attention.paged_decode_attention(torch.zeros(1, 2, 64), k, v, pages, lengths.long(), PAGE)
    with pytest.raises(RuntimeError, match="reads page 4, outside the pool of 4 pages"):
        cpu_attention.paged_decode_attention(torch.zeros(1, 2, 64), k, v, pages + 4, lengths, PAGE)
    with pytest.raises(RuntimeError, match="attends 17 slots, its page table covers 16"):
        cpu_attention.paged_decode_attention(torch.zeros(1, 2, 64), k, v, pages, lengths + 16, PAGE)


def _huge_kib() -> int:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(rollup.split("AnonHugePages:")[1].split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="the OS gives no transparent huge pages")
def test_kv_tensors_sit_on_huge_pages():
    before = _huge_kib()
    t = kv_tensor((3, 64 * 2**20 // 384, 64), torch.bfloat16, torch.device("cpu"))   # 64 MiB
    assert t.shape == (3, 64 * 2**20 // 384, 64) and not t.any()
    assert _huge_kib() - before >= 32 * 1024
