"""Software prefetch in inductor's AMX micro-GEMM, for the decode steps compiled on the CPU (a speed
edit: `EngineConfig.amx_gemm_edits` turns it off; CPUs without AMX never run this template).

At decode M is the batch (1-32 rows): each 2 KiB tile of packed weights feeds a couple of tile
multiplies, and the GEMMs wait on memory. Inductor's AMX micro-kernel (torch 2.13's
`CppMicroGemmAMX`, whose template says "TODO: add prefetch hint for A, B, C") loads a weight tile
only when it multiplies it, so few tiles are ever in flight: the weights streamed at ~16 GB/s where a
plain read of them reaches ~26. Within `patched()` the template also prefetches, into L2, the weight
tiles it will load `DISTANCE` k-steps later; a thread's column blocks lie one after another in the
packed weight, so near the end of a block the prefetch runs on into the next (its measured gain:
bench/RESULTS.md, "AMX micro-GEMM edits"). Where torch's template differs from the one this was
written for, nothing is patched.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Iterator

from torch._inductor.custom_graph_pass import CustomGraphPass

DISTANCE = 8                              # k-steps ahead (one k-step: 32 rows, 2 KiB of bf16 tiles)
_ANCHOR = "    auto compute = [&](int k) {\n"
# The lines every later `_tile_loadd` of B reads: 16 rows of 64 bytes for each column tile.
_PREFETCH = _ANCHOR + """\
{%- for tile_col in range(num_columns) %}
        for (int row = 0; row < 16; ++row)
            _mm_prefetch(reinterpret_cast<const char*>(
                B + (k + """ + str(DISTANCE) + """ * {{block_k}}) * ldb + row * ldb * {{vnni_size}} + {{tile_col * 16 * vnni_size}}),
                _MM_HINT_T1);
{%- endfor %}
"""
# (template text, its replacement), each found exactly once in the template.
_EDITS = ((_ANCHOR, _PREFETCH),)
_lock = threading.Lock()
_users = 0
_original: str | None = None


def _template_class():
    import torch._inductor.compile_fx  # noqa: F401  (imports the codegen modules in a working order)
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmAMX
    return CppMicroGemmAMX


def applies() -> bool:
    """Whether this torch's AMX micro-GEMM template is the one the patch is written for."""
    template = _template_class().TEMPLATE_KERNEL
    return all(template.count(old) == 1 for old, _ in _EDITS)


def in_use() -> bool:
    """Whether inductor compiles AMX GEMMs here (the CPU has AMX tiles and torch dispatches at the
    AVX-512 level: ATEN_CPU_CAPABILITY=avx2 turns both off) and the patch fits its template."""
    import torch
    return (torch.cpu._is_amx_tile_supported() and torch.backends.cpu.get_cpu_capability().lower() == "avx512"
            and applies())


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Inductor compiles AMX GEMMs with the edits while any thread is inside this block."""
    global _users, _original
    cls = _template_class()
    with _lock:
        if _users == 0 and applies():
            _original = cls.TEMPLATE_KERNEL
            for old, new in _EDITS:
                cls.TEMPLATE_KERNEL = cls.TEMPLATE_KERNEL.replace(old, new)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _original is not None:
                cls.TEMPLATE_KERNEL, _original = _original, None


class CacheKey(CustomGraphPass):
    """A graph pass that does nothing: its uuid puts the patch into inductor's FX graph cache key, so
    a graph compiled with the edits is never served to a compile without them, or the reverse."""

    def __call__(self, graph) -> None:
        pass

    def uuid(self) -> str:
        return hashlib.sha256(repr(_EDITS).encode()).hexdigest()
