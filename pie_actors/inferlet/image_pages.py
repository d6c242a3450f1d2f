"""The pages of a component's memory image that its runs write, copied into each new instance at once.

Why: wasmtime maps a new instance's linear memory copy-on-write from the component's memory image
(the runner's snapshot of CPython, ~16 MiB). The guest reads a page before it writes it (a
reference count is a load, then a store), so the read maps the image's page read-only and the
write then copies it; to take the read-only mapping back the kernel flushes the TLB of every core
that runs this process, with an interrupt to each of them: ~15 µs a page on the hosts here, where
a copy made before any read costs ~2 µs, and each interrupt also stops the engine's threads on
the other core (bench/RESULTS.md, "Sandbox memory: image pages copied ahead"). A run of the runner
writes the same ~600 pages of the image every time. So the first runs of a component are watched
(which of the image's pages ended up copied: /proc/self/pagemap), and from then on every new
instance gets those pages copied before the guest starts, one madvise(MADV_POPULATE_WRITE) a run
of pages: no read-only mapping to take back, no flush.

The instance's mapping of the image is found in /proc/self/maps: the one mapping of the
component's file that instantiation added (instantiations of one file take turns, so the
difference is exactly the new instance's). Linux 5.14 or later; elsewhere, without
/proc/self/pagemap, or where a step fails, nothing is copied ahead and runs fault as before.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

Mapping = tuple[int, int]          # an instance's mapping of the image: [start, end) addresses

_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


class ImagePages:
    """The written pages of one component file's memory image (`of(path)`: one per file, shared by
    every Sandbox of it), and the copying ahead into its instances."""

    LEARN_RUNS = 3           # runs watched: what they wrote, together, is copied ahead in later ones

    _all: dict[str, "ImagePages"] = {}
    _all_lock = threading.Lock()

    @classmethod
    def of(cls, path: str) -> "ImagePages":
        path = os.path.realpath(path)      # as /proc/self/maps names it
        with cls._all_lock:
            pages = cls._all.get(path)
            if pages is None:
                pages = cls._all[path] = cls(path)
            return pages

    def __init__(self, path: str, enabled: bool = True) -> None:
        self.path = path = os.path.realpath(path)
        self.enabled = enabled and sys.platform == "linux" and os.access("/proc/self/pagemap", os.R_OK)
        self.written: set[int] = set()         # page indexes in the image that watched runs wrote
        self.ranges: list[tuple[int, int]] = []   # (first page, pages) copied into each instance
        self.watched = 0
        self._suffix = " " + path + "\n"
        self._lock = threading.Lock()
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise if self.enabled else None

    def instantiate(self, make: Callable[[], T]) -> tuple[T, Mapping | None, int]:
        """`make()` (the instantiation), its instance's mapping of the image (None: not found, or
        copying ahead is off) and how many pages were copied into it ahead."""
        if not self.enabled:
            return make(), None, 0
        with self._lock:
            before = self._mappings()
            made = make()
            new = self._mappings() - before
        mapping = new.pop() if len(new) == 1 else None
        return made, mapping, self._populate(mapping) if mapping is not None else 0

    def watch(self, mapping: Mapping | None) -> None:
        """After a run that went well, while its instance lives: the image pages it wrote are
        copied ahead in later instances (the first LEARN_RUNS runs)."""
        if mapping is None or self.watched >= self.LEARN_RUNS:
            return
        try:
            written = copied_pages(mapping)
        except OSError:
            self.enabled = False
            return
        with self._lock:
            self.watched += 1
            self.written |= written
            self.ranges = _runs(sorted(self.written))

    def _mappings(self) -> set[Mapping]:
        found = set()
        with open("/proc/self/maps") as f:
            for line in f:
                if line.endswith(self._suffix) and " rw-p " in line:
                    start, end = line.split(" ", 1)[0].split("-")
                    found.add((int(start, 16), int(end, 16)))
        return found

    def _populate(self, mapping: Mapping) -> int:
        start, end = mapping
        copied = 0
        for first, n in self.ranges:
            n = min(n, (end - start) // _PAGE - first)
            if n <= 0:
                continue
            if self._madvise(ctypes.c_void_p(start + first * _PAGE), ctypes.c_size_t(n * _PAGE),
                             _MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == 22:      # EINVAL: a kernel older than 5.14
                    self.enabled = False
                break
            copied += n
        return copied


def copied_pages(mapping: Mapping) -> set[int]:
    """The pages of a private file mapping that are copies now (written, or copied ahead), by
    index from its start: present (pagemap bit 63) and no longer the file's page (bit 61 clear)."""
    start, end = mapping
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // _PAGE * 8)
        entries = memoryview(f.read((end - start) // _PAGE * 8)).cast("Q")
    return {i for i, e in enumerate(entries) if e >> 63 and not e >> 61 & 1}


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page indexes as (first, count) runs of consecutive pages. (Copying the gaps too, to
    make fewer calls, costs more: the pages a run writes lie scattered.)"""
    runs: list[list[int]] = []
    for p in pages:
        if runs and p == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [(first, n) for first, n in runs]
