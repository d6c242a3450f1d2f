"""CPU kernels in C++ (csrc/), built at first use: paged decode attention, a few rows' linear layer,
a row argmax.

`paged_decode_attention` reads each lane's K and V pages where they lie, the CPU counterpart of the
Triton kernel (triton_attention.py); `linear_rows` is x W^T for decode batches and short prefills,
reading the weights once; `argmax_rows` is greedy sampling's argmax over the logits.
They are compiled once per machine with torch's extension builder (g++ and ninja, ~25 s; cached
under ~/.cache/torch_extensions) for the host's vector ISA. Where they cannot be built, `load` says
why once and returns False, and their callers keep torch ops.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128)                   # the attention kernel's compiled head sizes
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode.cpp", "linear_rows.cpp", "argmax.cpp")]
# Up to this many rows, `linear_rows` beats the BLAS's GEMM on the model's weights; from here on the
# product is bound by arithmetic, which the BLAS's packed GEMM does better (bench/RESULTS.md, "Linear
# layers: a few rows").
LINEAR_MAX_ROWS = 56
_loaded: bool | None = None             # None: not tried yet
# compiler flags by torch's CPU capability; vec.h picks its code path from the macros they set
_MARCH = {"avx512": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"],
          "default": ["-march=native", "-mno-avx512f", "-mno-avx2"]}
# A build takes ~25 s; a build lock older than this was left by a builder that was killed
STALE_LOCK_S = 600.0


def load() -> bool:
    """Build (or load the cached build of) the kernels; True when they can run."""
    global _loaded
    if _loaded is None:
        try:
            from torch.utils.cpp_extension import get_default_build_root, load as load_extension
            if shutil.which("ninja") is None:   # the PyPI package's binary: PATH may lack the venv
                import ninja
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            # The ISA torch dispatches to (ATEN_CPU_CAPABILITY lowers it: how an AVX2-only host is
            # tried on a bigger one) picks the instructions; the cache directory is per ISA level,
            # so a home shared by different machines does not hand one machine another's.
            isa = torch.backends.cpu.get_cpu_capability().lower()
            name = f"pie_cpu_kernels_{isa}"
            # a directory per Python and torch version too: a build links against one libtorch
            version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
            build = Path(get_default_build_root()) / version / name
            build.mkdir(parents=True, exist_ok=True)
            clear_stale_lock(build)
            load_extension(name, [str(s) for s in _SOURCES], is_python_module=False, build_directory=str(build),
                           extra_cflags=["-O3", *_MARCH.get(isa, _MARCH["default"]), "-fopenmp"],
                           extra_ldflags=["-fopenmp"])
            torch.library.register_fake("pie_cpu::paged_decode_attention")(_fake_attention)
            torch.library.register_fake("pie_cpu::linear_rows")(_fake_linear)
            torch.library.register_fake("pie_cpu::argmax_rows")(_fake_argmax)
            _loaded = True
        except Exception as e:          # no compiler, no ninja, an unsupported platform
            log.warning("CPU kernels unavailable, using torch ops instead: %s", e)
            _loaded = False
    return _loaded


def clear_stale_lock(build: Path, stale_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock in `build` when it is older than `stale_s`: torch's extension builder
    waits for another process's build by polling for its lock file, forever, so one left by a
    builder that was killed (SIGKILL, an OOM) would hang every later engine start. True: removed."""
    lock = build / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < stale_s:
        return False            # a build in progress
    log.warning("removing the CPU kernels' build lock %s, left %.0f s ago by a build that did not finish",
                lock, age)
    lock.unlink(missing_ok=True)
    return True


def _fake_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                    lengths: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _fake_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _fake_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.long)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                           lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """q [B, Hq, D]; caches [Hkv, slots, D]; pages [B, P] int64 (a lane's page table, padded);
    lengths [B] int32 (slots attended). Returns [B, Hq, D]. Call `load` first."""
    return torch.ops.pie_cpu.paged_decode_attention(q, k_cache, v_cache, pages, lengths, page_size,
                                                    q.shape[-1] ** -0.5)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for float32 CPU tensors, weight [out, in]; it pays for up to
    `LINEAR_MAX_ROWS` rows of x (model/tp.py `linear`). Call `load` first."""
    return torch.ops.pie_cpu.linear_rows(x, weight, bias)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum (the first NaN where a row has one), like
    `logits.max(-1).indices`, for float32 [rows, vocab] CPU logits. Call `load` first."""
    return torch.ops.pie_cpu.argmax_rows(logits)
