"""Saved working sets: named by their owner, kept beyond the run that made them (`ws.save(name)`,
`WorkingSet.open(name)`), and the host-memory spill buffer behind them.

A saved set is a sequence of the KV store that no connection owns, forked off the working set when
it was saved (its frozen prefix), plus the token history of that prefix. It lives in one of three
states, and leaves each only for the next:

- kept: its pages stay in the page pool; opening it forks it (nothing is computed).
- spilled: an allocation found the pool short (`KVStore.reclaim`), and the least recently saved or
  opened sets were evicted: their K and V rows were copied into host memory, while the spill buffer
  (`spill_memory_mb`) had room. Opening it writes them back into new pages: kept again.
- tokens: evicted with no room in the spill buffer (or across tensor-parallel ranks, which spill
  nothing); only the token history is left. Opening it prefills the history into the new working
  set, prefix cache first, which recomputes the same KV.

Names are per owner (the API key that launched the process; None is the anonymous scope). The
engine calls every method here under its lock.
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kvstore import KVStore, KVStoreError, UnknownSaved
from .worker import Worker

__all__ = ["SavedSets"]

Key = tuple[str | None, str]           # (owner, name)


@dataclass
class _Saved:
    tokens: list[int]                  # the history: what recomputation prefills
    root: int                          # its prefix partition (the owner's): where it comes back
    seq: int | None = None             # its KV store sequence, while kept
    rows: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # K, V per layer, while spilled
    nbytes: int = 0                    # of `rows`

    @property
    def state(self) -> str:
        return "kept" if self.seq is not None else "spilled" if self.rows is not None else "tokens"


class SavedSets:
    """The engine's saved working sets. `pending_copies` are the page copies not yet run (a set
    forked just before it is spilled has its tail page still to be copied); `device` is held
    while a batch runs on the workers, and here while KV rows move to or from host memory."""

    def __init__(self, kv: KVStore, worker: Worker, spill_bytes: int,
                 pending_copies: Callable[[], list[tuple[int, int]]], device: threading.Lock) -> None:
        self.kv, self.worker, self.spill_bytes = kv, worker, spill_bytes
        self._pending_copies, self._device = pending_copies, device
        self._sets: OrderedDict[Key, _Saved] = OrderedDict()     # least recently saved or opened first
        self._opening: _Saved | None = None                     # not to be evicted meanwhile
        self.spilled_bytes = 0
        self.restored: Counter[str] = Counter()                 # opens by how: kept, spilled, recomputed
        kv.reclaim = self.reclaim

    def save(self, seq: int, key: Key) -> tuple[int, list[tuple[int, int]]]:
        """Keep `seq`'s frozen prefix under `key`, replacing what was saved there. Returns its
        number of tokens and the page copies the fork needs."""
        child, copies = self.kv.fork(seq, counted=False)   # the owner's programs do not hold it
        try:
            tokens = self.kv.history(child)
            if not tokens:
                raise KVStoreError("the working set holds no frozen tokens yet: nothing to save")
        except KVStoreError:
            self.kv.free(child)
            raise
        if key in self._sets:
            self.delete(key)
        self._sets[key] = _Saved(tokens, self.kv.root(child), seq=child)
        return len(tokens), copies

    def open(self, key: Key) -> tuple[int, str, list[int], list[tuple[int, int]]]:
        """A new sequence for the saved set `key`: (seq, how it was restored, the tokens left to
        prefill into it, the page copies its fork needs). How: "kept" (forked from its pages),
        "spilled" (written back from host memory, then forked) or "recomputed" (an empty sequence
        and the whole history to prefill)."""
        saved = self._get(key)
        self._sets.move_to_end(key)
        how = {"kept": "kept", "spilled": "spilled", "tokens": "recomputed"}[saved.state]
        self._opening = saved
        try:
            if how == "spilled":
                self._unspill(saved)
            if saved.seq is None:
                seq, prefill, copies = self.kv.create(saved.root), saved.tokens, []
            else:
                (seq, copies), prefill = self.kv.fork(saved.seq), []
        finally:
            self._opening = None
        self.restored[how] += 1
        return seq, how, prefill, copies

    def delete(self, key: Key) -> None:
        saved = self._get(key)
        del self._sets[key]
        if saved.seq is not None:
            self.kv.free(saved.seq)
        self.spilled_bytes -= saved.nbytes

    def listing(self, owner: str | None) -> list[dict]:
        """`owner`'s saved sets: {"name", "state", "tokens"}, by name."""
        return [{"name": name, "state": s.state, "tokens": len(s.tokens)}
                for (o, name), s in sorted(self._sets.items(), key=lambda item: item[0][1]) if o == owner]

    def stats(self) -> dict[str, int]:
        """Saved sets by state, the bytes the spill buffer holds, and opens by how they restored."""
        states = Counter(s.state for s in self._sets.values())
        return {"kept": states["kept"], "spilled": states["spilled"], "tokens": states["tokens"],
                "spill_bytes": self.spilled_bytes,
                **{f"opened_{how}": self.restored[how] for how in ("kept", "spilled", "recomputed")}}

    # ---- eviction ----------------------------------------------------------------------------------
    def reclaim(self, short: int) -> None:
        """Evict kept sets, least recently used first, until `short` more pages are available (or
        none is left to evict)."""
        target = self.kv.available() + short
        for saved in list(self._sets.values()):
            if self.kv.available() >= target:
                return
            if saved.seq is not None and saved is not self._opening:
                self._evict(saved)

    def _evict(self, saved: _Saved) -> None:
        pages = self.kv.kv_pages(saved.seq)
        nbytes = len(pages) * self._page_bytes()
        if self.worker.comm.world_size == 1 and self.spilled_bytes + nbytes <= self.spill_bytes:
            # A page whose copy has not run yet holds nothing: read its source instead.
            source = {dst: src for src, dst in self._pending_copies()}
            for i, page in enumerate(pages):
                while page in source:
                    page = source[page]
                pages[i] = page
            with self._device:
                saved.rows = self.worker.read_pages(pages)
            saved.nbytes = nbytes
            self.spilled_bytes += nbytes
        self.kv.free(saved.seq)
        saved.seq = None

    def _unspill(self, saved: _Saved) -> None:
        seq = self.kv.restore(saved.tokens, saved.root)
        with self._device:
            self.worker.write_pages(self.kv.kv_pages(seq), saved.rows)
        saved.seq, saved.rows = seq, None
        self.spilled_bytes -= saved.nbytes
        saved.nbytes = 0

    def _page_bytes(self) -> int:
        """Bytes of one page's K and V rows over every layer (this rank's heads)."""
        return self.kv.page_size * sum(2 * k.shape[0] * k.shape[2] * k.element_size()
                                       for k, _ in self.worker.kv_caches)

    def _get(self, key: Key) -> _Saved:
        try:
            return self._sets[key]
        except KeyError:
            owner, name = key
            raise UnknownSaved(f"no saved working set named {name!r}"
                               + (" for this owner" if owner is not None else "")) from None
