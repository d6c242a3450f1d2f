"""The CUDA paged decode kernel equals every form of the CPU gather path, checked with Triton's interpreter.

TRITON_INTERPRET must be set before Triton is imported, so the check runs in a fresh interpreter.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import torch
    from pie_actors.gpu.kernels.attention import AttentionMetadata, LanePlan, _decode_attention, _gather
    from pie_actors.gpu.kernels.triton_attention import paged_decode_attention

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
        got = paged_decode_attention(q, k, v, meta.decode.pages, meta.decode.lengths, page)
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
