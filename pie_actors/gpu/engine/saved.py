"""Working sets that may leave the KV page pool when it runs short, and the host-memory spill
buffer behind them: saved working sets (`ws.save(name)`, `WorkingSet.open(name)`) and the working
sets of parked programs (`Engine.park`).

An evictable set is a KV store sequence that keeps its id while out of the pool (`KVStore.evict`).
It lives in one of three states, and leaves each only for the next:

- kept: its pages stay in the page pool.
- spilled: an allocation found the pool short (`KVStore.reclaim`) and evicted it: its K and V rows
  were copied into host memory, while the spill buffer (`spill_memory_mb`) had room. Writing them
  back into new pages makes it kept again.
- tokens: evicted with no room in the spill buffer (or across tensor-parallel ranks, which spill
  nothing); only its token history is left. A prefill of the history, prefix cache first,
  recomputes the same KV.

When the pool runs short, the sets of parked programs go first, least recently parked first, then
the saved sets, least recently saved or opened first.

A saved set is a sequence that no connection owns, forked off the working set when it was saved
(its frozen prefix). Opening it forks it (kept), writes it back first (spilled), or makes a new
sequence and prefills the history into it (tokens: the saved set stays tokens only). Names are per
owner (the API key that launched the process; None is the anonymous scope).

A parked set is a working set of a program that waits for a message with no pass in flight (the
data plane's `park`). It comes back in place, under the same sequence id, before the program's
next pass (`Engine.unpark`): written back, or emptied and prefilled with its history, whose
failure leaves it evicted again so that no pass reads a half-made set. One written with explicit
positions, slots or masks, or with rows not yet frozen, has no history that recomputes it: it
leaves the pool only for the spill buffer.

The engine calls every method here under its lock.
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ...kvstore import KVStore, KVStoreError, UnknownSaved
from .worker import Worker

__all__ = ["ParkedSets", "SavedSets", "Spill"]

Key = tuple[str | None, str]           # (owner, name)


@dataclass
class _Set:
    seq: int                           # its KV store sequence, also while evicted
    tokens: list[int] | None = None    # the history a prefill recomputes it from, when known
    evicted: bool = False
    rows: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # K, V per layer, while spilled
    nbytes: int = 0                    # of `rows`

    @property
    def state(self) -> str:
        return "kept" if not self.evicted else "spilled" if self.rows is not None else "tokens"


@dataclass
class _Saved(_Set):
    root: int = 0                      # its prefix partition (the owner's): where it is opened


class Spill:
    """Moves sets out of the pool and back, and picks which go when it runs short (`reclaim`, the
    KV store's hook): the sets of each of `queues` in turn, in order, none of `keep`; each queue
    counts its evictions by the state they left its sets in.
    `pending_copies` is the engine's list of page copies not yet run (a set forked just before
    it is evicted has its tail page still to be copied); `device` is held while a batch runs on
    the workers, and here while KV rows move to or from host memory."""

    def __init__(self, kv: KVStore, worker: Worker, spill_bytes: int,
                 pending_copies: Callable[[], list[tuple[int, int]]], device: threading.Lock) -> None:
        self.kv, self.worker, self.spill_bytes = kv, worker, spill_bytes
        self._pending_copies, self._device = pending_copies, device
        self.queues: list[tuple[OrderedDict[object, _Set], Counter[str]]] = []
        self.keep: set[int] = set()           # sequences being brought back: not to be evicted
        self.spilled_bytes = 0
        kv.reclaim = self.reclaim

    def reclaim(self, short: int) -> None:
        """Evict kept sets until `short` more pages are available (or none is left to evict)."""
        target = self.kv.available() + short
        for queue, evictions in self.queues:
            for s in list(queue.values()):
                if self.kv.available() >= target:
                    return
                if not s.evicted and s.seq not in self.keep and self.evict(s):
                    evictions[f"evicted_{s.state}"] += 1

    def evict(self, s: _Set) -> bool:
        """Spill `s` to host memory if the buffer has room, else keep its history only; False (and
        nothing changed) when it has neither room nor a history that recomputes it."""
        pages = self.kv.kv_pages(s.seq)
        if not pages:
            return False
        nbytes = len(pages) * self._page_bytes()
        spill = self.worker.comm.world_size == 1 and self.spilled_bytes + nbytes <= self.spill_bytes
        if not spill and s.tokens is None:
            if not self.kv.replayable(s.seq):
                return False
            s.tokens = self.kv.history(s.seq)
        # A page whose copy has not run yet holds nothing: read its source instead, and drop the
        # copy, since the page may belong to another sequence by the time it would run.
        copies = self._pending_copies()
        source = {dst: src for src, dst in copies}
        if spill:
            for i, page in enumerate(pages):
                while page in source:
                    page = source[page]
                pages[i] = page
            with self._device:
                s.rows = self.worker.read_pages(pages)
            s.nbytes = nbytes
            self.spilled_bytes += nbytes
        released = set(self.kv.evict(s.seq))
        if source.keys() & released:
            copies[:] = [(src, dst) for src, dst in copies if dst not in released]
        s.evicted = True
        return True

    def unspill(self, s: _Set) -> None:
        """Write a spilled set back into new pages: kept again (OutOfPages: it stays spilled)."""
        pages = self.kv.reload(s.seq)
        written = s.rows[0][0].shape[1] // self.kv.page_size    # pages with rows (none reserved past them)
        with self._device:
            self.worker.write_pages(pages[:written], s.rows)
        self.forget(s)
        s.evicted = False

    def forget(self, s: _Set) -> None:
        """Drop what `s` holds in host memory."""
        self.spilled_bytes -= s.nbytes
        s.rows, s.nbytes = None, 0

    def _page_bytes(self) -> int:
        """Bytes of one page's K and V rows over every layer (this rank's heads)."""
        return self.kv.page_size * sum(2 * k.shape[0] * k.shape[2] * k.element_size()
                                       for k, _ in self.worker.kv_caches)


class SavedSets:
    """The engine's saved working sets, by (owner, name)."""

    def __init__(self, spill: Spill) -> None:
        self.spill, self.kv = spill, spill.kv
        self._sets: OrderedDict[Key, _Saved] = OrderedDict()     # least recently saved or opened first
        self.restored: Counter[str] = Counter()                 # opens by how: kept, spilled, recomputed
        self.evictions: Counter[str] = Counter()                # evicted_spilled, evicted_tokens
        spill.queues.append((self._sets, self.evictions))

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
        self._sets[key] = _Saved(child, tokens, root=self.kv.root(child))
        return len(tokens), copies

    def open(self, key: Key) -> tuple[int, str, list[int], list[tuple[int, int]]]:
        """A new sequence for the saved set `key`: (seq, how it was restored, the tokens left to
        prefill into it, the page copies its fork needs). How: "kept" (forked from its pages),
        "spilled" (written back from host memory, then forked) or "recomputed" (an empty sequence
        and the whole history to prefill)."""
        saved = self._get(key)
        self._sets.move_to_end(key)
        how = {"kept": "kept", "spilled": "spilled", "tokens": "recomputed"}[saved.state]
        if how == "recomputed":
            seq, prefill, copies = self.kv.create(saved.root), saved.tokens, []
        else:
            self.spill.keep.add(saved.seq)
            try:
                if how == "spilled":
                    self.spill.unspill(saved)
                (seq, copies), prefill = self.kv.fork(saved.seq), []
            finally:
                self.spill.keep.discard(saved.seq)
        self.restored[how] += 1
        return seq, how, prefill, copies

    def delete(self, key: Key) -> None:
        saved = self._get(key)
        del self._sets[key]
        self.kv.free(saved.seq)
        self.spill.forget(saved)

    def listing(self, owner: str | None) -> list[dict]:
        """`owner`'s saved sets: {"name", "state", "tokens"}, by name."""
        return [{"name": name, "state": s.state, "tokens": len(s.tokens)}
                for (o, name), s in sorted(self._sets.items(), key=lambda item: item[0][1]) if o == owner]

    def stats(self) -> dict[str, int]:
        """Saved sets by state, the bytes they hold in host memory, evictions by the state they
        left, and opens by how they restored."""
        return {**_states(self._sets.values()), **{k: self.evictions[k] for k in _EVICTIONS},
                **{f"opened_{how}": self.restored[how] for how in ("kept", "spilled", "recomputed")}}

    def _get(self, key: Key) -> _Saved:
        try:
            return self._sets[key]
        except KeyError:
            owner, name = key
            raise UnknownSaved(f"no saved working set named {name!r}"
                               + (" for this owner" if owner is not None else "")) from None


class ParkedSets:
    """The working sets of parked programs, by sequence, least recently parked first."""

    def __init__(self, spill: Spill) -> None:
        self.spill, self.kv = spill, spill.kv
        self._sets: OrderedDict[int, _Set] = OrderedDict()
        self.moves: Counter[str] = Counter()   # evicted_spilled, evicted_tokens, restored_spilled, restored_recomputed
        spill.queues.insert(0, (self._sets, self.moves))     # the first to leave the pool

    def __bool__(self) -> bool:
        return bool(self._sets)

    def park(self, seqs: Iterable[int]) -> None:
        for seq in seqs:
            if seq not in self._sets:
                self._sets[seq] = _Set(seq)

    def unpark(self, seqs: Iterable[int]) -> list[tuple[int, list[int]]]:
        """Bring back the parked sets among `seqs`: the spilled ones are written back now, the
        evicted ones are emptied and returned with the history to prefill into them, (seq,
        tokens). On OutOfPages (or QuotaExceeded) those not back yet stay parked."""
        sets = [self._sets.pop(seq) for seq in seqs if seq in self._sets]   # out of `reclaim`'s reach
        # Writing back may fail for want of pages; emptying cannot, so it comes after, once nothing
        # can stop its prefill from being queued.
        spilled = [s for s in sets if s.state == "spilled"]
        for s in spilled:
            try:
                self.spill.unspill(s)
            except KVStoreError:
                self._sets.update((t.seq, t) for t in sets if t.evicted)
                raise
            self.moves["restored_spilled"] += 1
        prefills = []
        for s in sets:
            if s.evicted:
                prefills.append((s.seq, self.kv.reset(s.seq)))
                self.moves["restored_recomputed"] += 1
        return prefills

    def prefill_failed(self, seq: int, tokens: list[int]) -> None:
        """The prefill bringing `seq` back failed (and was rolled back): it is evicted again, so
        the passes after it fail rather than read a set that is not all there."""
        try:
            self.kv.evict(seq)
        except KVStoreError:
            return                              # freed meanwhile
        self._sets[seq] = _Set(seq, tokens, evicted=True)

    def forget(self, seq: int) -> None:
        """`seq` was freed."""
        s = self._sets.pop(seq, None)
        if s is not None:
            self.spill.forget(s)

    def stats(self) -> dict[str, int]:
        """Parked sets by state, the bytes they hold in host memory, and how many left the pool
        and came back, by how."""
        return {"sets": len(self._sets), **_states(self._sets.values()),
                **{k: self.moves[k] for k in (*_EVICTIONS, "restored_spilled", "restored_recomputed")}}


_EVICTIONS = ("evicted_spilled", "evicted_tokens")


def _states(sets: Iterable[_Set]) -> dict[str, int]:
    """Sets by state, and the bytes they hold in host memory."""
    sets = list(sets)
    states = Counter(s.state for s in sets)
    return {"kept": states["kept"], "spilled": states["spilled"], "tokens": states["tokens"],
            "spill_bytes": sum(s.nbytes for s in sets)}
