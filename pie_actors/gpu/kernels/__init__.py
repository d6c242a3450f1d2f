"""Kernels and the fast decode path, one concept a file:

    attention.py         paged attention over a flat slot array (prefill and decode forms)
    triton_attention.py  paged decode attention in Triton (CUDA)
    cpu_kernels.py       builds and calls csrc/*.cpp: CPU paged decode attention, a few rows'
                         linear layer (a setting), greedy argmax
    compiled_decode.py   decode batches at bucketed shapes, compiled ahead of time into packages
    amx_gemm.py          prefetch and cache-hint edits to inductor's AMX GEMM template (a setting)
    hugepages.py         weights and KV pages on transparent huge pages, CPU (a setting)
"""
import os as _os

from ...config import pie_home as _pie_home

# Inductor's caches (compiled kernels, GEMM autotuning) under $PIE_HOME/cache, so that later compiles
# on this machine reuse them. Set here, before anything imports torch._inductor (which fixes its folder on import); an explicit
# TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR wins.
_os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_pie_home() / "cache" / "inductor"))
_os.environ.setdefault("TRITON_CACHE_DIR", str(_pie_home() / "cache" / "triton"))
