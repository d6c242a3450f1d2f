"""The CUDA paged decode kernel equals every form of the CPU gather path, checked with Triton's interpreter.

TRITON_INTERPRET must be set before Triton is imported, so the check runs in a fresh interpreter.
CHECK takes a device argument: "cuda" runs the compiled kernel (tests/test_cuda.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import sys
    import torch
    from pie_actors.gpu.kernels.attention import AttentionMetadata, LanePlan, _decode_attention, _gather
    from pie_actors.gpu.kernels.triton_attention import paged_decode_attention

    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    g = torch.Generator().manual_seed(0)
    page, pool, hkv, d = 4, 24, 2, 16
    for hq in (2, 6):                                  # plain attention and a GQA group of 3
        k = torch.randn(hkv, pool * page, d, generator=g)
        v = torch.randn(hkv, pool * page, d, generator=g)
        lanes = [LanePlan(0, 1, [5, 2, 9], 11),        # partial last page
                 LanePlan(1, 1, [7], 1),               # a single slot
                 LanePlan(2, 1, [3, 4, 8, 1], 16),     # full pages
                 LanePlan(3, 1, [6, 10], 8, q_slots=[5])]   # explicit slot: attends slots 0..5 only
        meta = AttentionMetadata.build(lanes, [0, 1, 2, 3], page, torch.device("cpu"))
        q = torch.randn(len(lanes), hq, d, generator=g)
        on = AttentionMetadata.build(lanes, [0, 1, 2, 3], page, device).decode
        got = paged_decode_attention(q.to(device), k.to(device), v.to(device), on.pages, on.lengths, page).cpu()
        for form in ("matmul", "fused_scores", "fused"):   # every CPU form
            want = _decode_attention(q, _gather(k, meta.decode.index), _gather(v, meta.decode.index),
                                     meta.decode.mask, form)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    print("ok")
""")


def test_triton_paged_decode_matches_gather_path():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
