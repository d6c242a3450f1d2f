"""Kernels and the fast decode path, one concept a file:

    attention.py         paged attention over a flat slot array (prefill and decode forms)
    triton_attention.py  paged decode attention in Triton (CUDA)
    cpu_kernels.py       builds and calls csrc/*.cpp: CPU paged decode attention and greedy argmax
    compiled_decode.py   torch.compile of decode batches at bucketed shapes
    amx_gemm.py          prefetch and cache-hint edits to inductor's AMX GEMM template (a setting)
    hugepages.py         weights and KV pages on transparent huge pages, CPU (a setting)
"""
