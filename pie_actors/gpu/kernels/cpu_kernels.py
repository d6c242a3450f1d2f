"""CPU kernels in C++ (csrc/), built at first use: paged decode attention and a row argmax.

`paged_decode_attention` reads each lane's K and V pages where they lie, the CPU counterpart of the
Triton kernel (triton_attention.py); `argmax_rows` is greedy sampling's argmax over the logits.
Both are compiled once per machine with torch's extension builder (g++ and ninja, ~25 s; cached
under ~/.cache/torch_extensions) for the host's vector ISA. Where they cannot be built, `load` says
why once and returns False, and their callers keep torch ops.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128)                   # the attention kernel's compiled head sizes
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode.cpp", "argmax.cpp")]
_loaded: bool | None = None             # None: not tried yet
# compiler flags by torch's CPU capability; vec.h picks its code path from the macros they set
_MARCH = {"avx512": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"],
          "default": ["-march=native", "-mno-avx512f", "-mno-avx2"]}


def load() -> bool:
    """Build (or load the cached build of) the kernels; True when they can run."""
    global _loaded
    if _loaded is None:
        try:
            from torch.utils.cpp_extension import load as load_extension
            if shutil.which("ninja") is None:   # the PyPI package's binary: PATH may lack the venv
                import ninja
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            # The ISA torch dispatches to (ATEN_CPU_CAPABILITY lowers it: how an AVX2-only host is
            # tried on a bigger one) picks the instructions; the cache directory is per ISA level,
            # so a home shared by different machines does not hand one machine another's.
            isa = torch.backends.cpu.get_cpu_capability().lower()
            load_extension(f"pie_cpu_kernels_{isa}", [str(s) for s in _SOURCES], is_python_module=False,
                           extra_cflags=["-O3", *_MARCH.get(isa, _MARCH["default"]), "-fopenmp"],
                           extra_ldflags=["-fopenmp"])
            torch.library.register_fake("pie_cpu::paged_decode_attention")(_fake_attention)
            torch.library.register_fake("pie_cpu::argmax_rows")(_fake_argmax)
            _loaded = True
        except Exception as e:          # no compiler, no ninja, an unsupported platform
            log.warning("CPU kernels unavailable, using torch ops instead: %s", e)
            _loaded = False
    return _loaded


def _fake_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                    lengths: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _fake_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                           lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """q [B, Hq, D]; caches [Hkv, slots, D]; pages [B, P] int64 (a lane's page table, padded);
    lengths [B] int32 (slots attended). Returns [B, Hq, D]. Call `load` first."""
    return torch.ops.pie_cpu.paged_decode_attention(q, k_cache, v_cache, pages, lengths, page_size,
                                                    q.shape[-1] ** -0.5)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum (the first NaN where a row has one), like
    `logits.max(-1).indices`, for float32 [rows, vocab] CPU logits. Call `load` first."""
    return torch.ops.pie_cpu.argmax_rows(logits)
