"""The C++ kernels (pie_actors/gpu/kernels/csrc): paged decode attention equals the torch gather path and
rejects bad shapes; a few rows' linear layer equals F.linear; the row argmax equals torch.max's
indices; KV tensors sit on huge pages."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pie_actors.gpu.kernels import cpu_kernels
from pie_actors.gpu.kernels.attention import AttentionMetadata, LanePlan, _decode_attention, _gather
from pie_actors.gpu.eta.ops import argmax

PAGE = 16
LANES = [LanePlan(0, 1, [5, 2, 9], 40),             # partial last page
         LanePlan(1, 1, [7], 1),                    # a single slot
         LanePlan(2, 1, [3, 4, 8, 1], 64),          # full pages
         LanePlan(3, 1, [6, 10], 32, q_slots=[20]),  # explicit slot: attends slots 0..20 only
         LanePlan(4, 1, [0, 11, 12, 13, 14, 15, 16, 17, 18, 19], 150)]


def setup_module():
    assert cpu_kernels.load(), "the kernel did not build (see the warning logged)"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("head_dim", cpu_kernels.HEAD_DIMS)
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (9, 3), (8, 2)])
def test_kernel_matches_gather_path(dtype, tol, head_dim, q_heads, kv_heads):
    g = torch.Generator().manual_seed(head_dim + q_heads)
    pool = 24
    k = torch.randn(kv_heads, pool * PAGE, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, pool * PAGE, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata.build(LANES, list(range(len(LANES))), PAGE, torch.device("cpu"))
    q = torch.randn(len(LANES), q_heads, head_dim, generator=g).to(dtype)
    got = cpu_kernels.paged_decode_attention(q, k, v, meta.decode.pages, meta.decode.lengths, PAGE)
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
    compiled = torch.compile(cpu_kernels.paged_decode_attention, fullgraph=True)
    torch.testing.assert_close(compiled(*args), cpu_kernels.paged_decode_attention(*args))


def test_kernel_rejects_bad_input():
    k = v = torch.zeros(2, 4 * PAGE, 80)
    pages, lengths = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head_dim 80"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 2, 80), k, v, pages, lengths, PAGE)
    k = v = torch.zeros(2, 4 * PAGE, 64)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 3, 64), k, v, pages, lengths, PAGE)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 2, 64, dtype=torch.bfloat16), k, v, pages, lengths, PAGE)
    with pytest.raises(RuntimeError, match="lengths int32"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 2, 64), k, v, pages, lengths.long(), PAGE)
    with pytest.raises(RuntimeError, match="reads page 4, outside the pool of 4 pages"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 2, 64), k, v, pages + 4, lengths, PAGE)
    with pytest.raises(RuntimeError, match="attends 17 slots, its page table covers 16"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 2, 64), k, v, pages, lengths + 16, PAGE)


# rows: one, the edges of a 4-row tile, past LINEAR_MAX_ROWS; [out, in]: the model's shapes, and sizes
# that are not whole tiles or whole vectors
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 48, 70])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (7, 5), (1, 33), (13, 100)])
def test_linear_rows_matches_f_linear(m, out_features, in_features):
    g = torch.Generator().manual_seed(m * 1000 + out_features)
    x = torch.randn(m, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    # float32 sums of up to 1,536 products in another order than the BLAS's: equal to ~1e-5 relative
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cpu_kernels.linear_rows(x, w), torch.nn.functional.linear(x, w), **close)
    torch.testing.assert_close(cpu_kernels.linear_rows(x, w, b), torch.nn.functional.linear(x, w, b), **close)


def test_linear_rows_layouts_and_bad_input():
    x, w = torch.randn(2, 3, 64), torch.randn(40, 64)
    y = cpu_kernels.linear_rows(x, w)                              # leading dimensions kept
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cpu_kernels.linear_rows(x[:, ::2], w.t().contiguous().t()),   # strided views
                               torch.nn.functional.linear(x[:, ::2], w), rtol=1e-4, atol=1e-4)
    compiled = torch.compile(cpu_kernels.linear_rows, fullgraph=True)
    torch.testing.assert_close(compiled(x, w), y)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.linear_rows(x.double(), w.double())
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_kernels.linear_rows(x, torch.randn(40, 63))
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.linear_rows(x, w, torch.randn(39))


@pytest.mark.parametrize("shape", [(32, 49152), (1, 49152), (3, 7), (2, 64), (4, 65), (5, 1000), (1, 1)])
def test_argmax_matches_torch_max(shape):
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=g)
    assert torch.equal(cpu_kernels.argmax_rows(x), x.max(-1).indices)
    ties = torch.randint(0, 3, shape, generator=g).float()      # many equal maxima: the first wins
    assert torch.equal(cpu_kernels.argmax_rows(ties), ties.max(-1).indices)


def test_argmax_nan_inf_and_layouts():
    x = torch.randn(6, 1000)
    x[0, 7] = x[0, 900] = float("nan")                 # the first NaN, in the vector part
    x[1, 998] = float("nan")                           # in the tail
    x[2, 3] = float("inf")
    x[3] = float("-inf")                               # all -inf: index 0
    x[4, 500] = x[4, 40] = 1e9                         # equal maxima in different vector lanes
    assert cpu_kernels.argmax_rows(x).tolist() == [7, 998, 3, 0, 40, int(x[5].max(-1).indices)]
    assert torch.equal(cpu_kernels.argmax_rows(x.T.contiguous().T), x.max(-1).indices)  # a strided view
    assert torch.equal(argmax(x[2]), torch.tensor(3)) and torch.equal(argmax(x.T, 0), x.max(-1).indices)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.argmax_rows(x.double())
    with pytest.raises(RuntimeError, match="non-empty"):
        cpu_kernels.argmax_rows(torch.zeros(2, 0))


THP = (sys.platform.startswith("linux")
       and "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text())


def _huge_pages_gained(code: str) -> int:
    """KiB of huge pages the process gains running `code`, in a fresh process: in this one, memory
    freed by earlier tests (some of it huge) would be reused and blur the count."""
    script = f"""
from pathlib import Path
import torch
from pie_actors.gpu.kernels import hugepages
def huge():
    return int(Path("/proc/self/smaps_rollup").read_text().split("AnonHugePages:")[1].split()[0])
before = huge()
{code}
print(huge() - before)
"""
    return int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True).stdout)


@pytest.mark.skipif(not THP, reason="the OS gives no transparent huge pages")
def test_kv_tensors_sit_on_huge_pages():
    assert _huge_pages_gained("""
t = hugepages.zeros((3, 64 * 2**20 // 384, 64), dtype=torch.bfloat16, device=torch.device("cpu"))   # 64 MiB
assert t.shape == (3, 64 * 2**20 // 384, 64) and not t.any()
""") >= 32 * 1024


@pytest.mark.skipif(not THP or tuple(map(int, platform.release().split(".")[:2])) < (6, 1),
                    reason="MADV_COLLAPSE needs Linux 6.1 and transparent huge pages")
def test_advise_moves_tensors_in_use_onto_huge_pages():
    code = """
t = torch.arange(16 * 2**20, dtype=torch.float32)   # 64 MiB on small pages, in use
{}
assert torch.equal(t, torch.arange(16 * 2**20, dtype=torch.float32))   # contents kept
"""
    if "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        assert _huge_pages_gained(code.format("")) < 32 * 1024   # small pages unless asked
    assert _huge_pages_gained(code.format("hugepages.advise([t])")) >= 32 * 1024


def test_a_build_lock_left_by_a_killed_builder_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's extension builder waits forever on another build's lock file: one older than any
    build takes is removed before building, one of a build in progress stays."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not cpu_kernels.clear_stale_lock(tmp_path) and lock.exists()
    old = lock.stat().st_mtime - cpu_kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert cpu_kernels.clear_stale_lock(tmp_path) and not lock.exists()
    assert not cpu_kernels.clear_stale_lock(tmp_path)        # no lock: nothing to do
