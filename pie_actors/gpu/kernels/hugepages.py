"""Transparent huge pages for the CPU tensors a decode step reads end to end: weights and the KV pool.

A decode step streams every weight once and every lane's KV pages. On 4 KiB pages each 4 KiB costs a
TLB miss and the hardware prefetchers stop at every page boundary: a 256 MB read runs ~26 GB/s on
huge pages here against 18-20 on small ones, and a batch-32 decode step is 1.02-1.05x faster with its
weights on huge pages (bench/RESULTS.md). Linux gives huge pages to anonymous memory that asks for
them (THP "madvise" mode, the usual default): MADV_HUGEPAGE before memory is first touched, and
MADV_COLLAPSE (Linux 6.1+) rebuilds memory already in use. Where neither works, nothing changes.
"""
from __future__ import annotations

import ctypes
import sys
from typing import Iterable

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _pages(t: torch.Tensor) -> range:
    """Start addresses of the huge pages covering t's storage. A small tensor shares its huge page
    with its neighbours in the heap; a collapse leaves their contents as they are."""
    storage = t.untyped_storage()
    return range(storage.data_ptr() // HUGE_PAGE * HUGE_PAGE, storage.data_ptr() + storage.nbytes(), HUGE_PAGE)


def _madvise(pages: Iterable[int], advice: int) -> None:
    """One call a huge page: one that is not wholly mapped (the edge of a mapping) fails alone."""
    if _libc is not None:
        for page in pages:
            _libc.madvise(ctypes.c_void_p(page), ctypes.c_size_t(HUGE_PAGE), advice)


def zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, on huge pages on a Linux CPU where the OS gives them."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if device.type != "cpu":
        return t.zero_()
    _madvise(_pages(t), _MADV_HUGEPAGE)   # fresh memory then faults in as huge pages ...
    t.zero_()
    _madvise(_pages(t), _MADV_COLLAPSE)   # ... memory reused from the heap is already mapped small
    return t


def advise(tensors: Iterable[torch.Tensor]) -> None:
    """Move the storages of these CPU tensors onto huge pages (pages already huge stay as they are)."""
    pages = sorted({page for t in tensors if t.device.type == "cpu" for page in _pages(t)})
    _madvise(pages, _MADV_HUGEPAGE)
    _madvise(pages, _MADV_COLLAPSE)
