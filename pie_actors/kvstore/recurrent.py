"""Recurrent-state bookkeeping: the state slot each sequence reads and writes, its checkpoints, and
the snapshots kept for prefix reuse (no tensors; states.py hands the slot numbers out).

A model with recurrent layers (linear attention) keeps a fixed-size state per sequence besides its
KV pages. A pass reads the sequence's state slot and writes the state after its rows into a new slot
(`advance`), which becomes the sequence's at commit (`take_pass`), or goes back at rollback
(`abort_pass`). A state holds every row written before it, so such a sequence takes rows in order,
without gaps, and goes back (cut, truncate, explicit slots that rewrite unfrozen rows) only to a
length where it keeps a checkpoint: a state saved on the way, in a slot of its own. A pass keeps
one at each row boundary it leaves unfrozen (explicit geometry: what a speculative pass may roll
back to) and at the lengths it is asked to (`Lane.checkpoints`, `fwd.checkpoints`); a run-ahead
pins the length before each of its runs (`pin`) until the run is read. Checkpoints below the
frozen prefix go once nothing pins them. A fork copies the state at the frozen length (the copy is
queued for the engine, `copies`).

Prefix reuse needs the state at the end of the reused pages as well: a canonical pass keeps the
state at each page boundary it crosses (the first `SNAPSHOTS_PER_PASS` of them), and the commit
that indexes the page there keeps that state as the page's snapshot, by chain key. A later append
reuses the deepest indexed page that has one, reading a copy of it. Snapshots are a cache: least
recently used first, they give their slots back when the state slots run out; no partition owns
them, so, like cached pages, they count against no bound.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .pool import InvalidSlot
from .states import OutOfStates, StatePass, StatePool

if TYPE_CHECKING:
    from .store import _Seq

SNAPSHOTS_PER_PASS = 8        # page boundaries a pass keeps the recurrent state at, for prefix reuse


class RecurrentStates:
    """The state slots of a store's sequences (held in their `_Seq` fields `state`, `checkpoints`,
    `pins`, `pending`) and the prefix snapshots, over one `StatePool`."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.pool = StatePool(num_slots)
        self.page_size = page_size
        self.copies: list[tuple[int, int]] = []  # (src, dst) state slots for the engine to copy
        self.snapshots: OrderedDict[int, int] = OrderedDict()  # chain key -> state slot, LRU first

    # -- a pass --------------------------------------------------------------------------------

    def advance(self, seq: int, s: _Seq, start: int, keep: Iterable[int]
                ) -> tuple[int, int, list[tuple[int, int]]]:
        """The slot a pass writing rows [start, length) reads, a new slot for the state after its
        rows, and [(rows, slot)] for the states it keeps at the lengths `keep`; all or nothing."""
        rewound = s.pending.rewound if s.pending is not None else None
        hit = s.pending.src if s.pending is not None else None
        src = hit if hit is not None else s.checkpoints[rewound[0]] if rewound is not None else s.state
        cuts = self.cuts(s, start, keep)
        room = len(self.pool.free) + len(self.snapshots)
        if len(cuts) + 1 > room:
            raise OutOfStates(f"sequence {seq}: the pass needs {len(cuts) + 1} recurrent-state slots (the "
                              f"state after it and {len(cuts)} checkpoints), {room} of the "
                              f"{self.pool.num_slots} are free or prefix snapshots")
        slots = [self.allocate() for _ in range(len(cuts) + 1)]
        s.pending = StatePass(slots[-1], dict(zip(cuts, slots)), rewound, hit)
        saves = [(n - start, slot) for n, slot in zip(cuts, slots)]
        return (self.pool.zero if src is None else src), slots[-1], saves

    @staticmethod
    def cuts(s: _Seq, start: int, keep: Iterable[int]) -> list[int]:
        """The lengths in `keep` inside a pass writing rows [start, length) of ``s``: where it keeps
        a checkpoint, each in a slot of its own."""
        return sorted({n for n in keep if start < n < s.length})

    def rewind_for(self, seq: int, s: _Seq, slots: list[int]) -> None:
        """Explicit slots: in order from the length or from a checkpoint, whose later rows they take
        back (restored if the pass fails)."""
        start = slots[0] if slots else s.length
        if slots != list(range(start, start + len(slots))):
            raise InvalidSlot(f"sequence {seq}: its recurrent state takes rows only in order, "
                              f"not at slots {slots[:8]}")
        if start < s.folded:
            raise InvalidSlot(f"sequence {seq}: slot {start} is frozen (folded={s.folded})")
        self.state_at(seq, s, start)
        if start < s.length:
            s.pending = StatePass(None, {}, (start, s.tokens[start:]))
            del s.tokens[start:]

    def take_pass(self, s: _Seq) -> None:
        """The states a pass wrote become the sequence's; those past where it started, taken back."""
        p, old = s.pending, s.state
        s.pending = None
        if p.src is not None:             # the copy of a snapshot it read
            self.pool.release(p.src)
        if p.rewound is not None:
            start = p.rewound[0]
            for n in [n for n in s.checkpoints if n > start]:
                self.forget(s, s.checkpoints.pop(n))
        s.state = p.dst
        for n, slot in p.saves.items():
            replaced = s.checkpoints.get(n)
            s.checkpoints[n] = slot
            self.forget(s, replaced)
        self.forget(s, old)

    def abort_pass(self, s: _Seq) -> None:
        """A pass that failed: its new slots go back, and the rows its explicit slots took back return."""
        if s.pending is None:
            return
        for slot in s.pending.slots():
            self.pool.release(slot)
        if s.pending.rewound is not None:
            start, rows = s.pending.rewound
            del s.tokens[start:]
            s.tokens += rows
        s.pending = None

    # -- going back ----------------------------------------------------------------------------

    def state_at(self, seq: int, s: _Seq, length: int) -> int | None:
        """The slot of the state after ``length`` rows (None: the zero state)."""
        if length == s.length:
            return s.state
        if length not in s.checkpoints:
            raise InvalidSlot(f"sequence {seq}: its recurrent state is kept at {s.length} rows and at "
                              f"{sorted(s.checkpoints)}, not at {length}")
        return s.checkpoints[length]

    def restore(self, seq: int, s: _Seq, length: int) -> None:
        """Before rows past ``length`` are dropped: the state there becomes the current one."""
        old, s.state = s.state, self.state_at(seq, s, length)
        for n in [n for n in s.checkpoints if n > length]:
            self.forget(s, s.checkpoints.pop(n))
        self.forget(s, old)

    def pin(self, s: _Seq) -> None:
        s.pins[s.length] += 1
        s.checkpoints[s.length] = s.state

    def unpin(self, s: _Seq, length: int) -> None:
        if s.pins[length] > 0:
            s.pins[length] -= 1
        if not s.pins[length]:
            del s.pins[length]
        self.prune(s)

    def prune(self, s: _Seq) -> None:
        """Checkpoints nothing may go back to any more: below the frozen prefix and not pinned."""
        for n in [n for n in s.checkpoints if (n < s.folded and n not in s.pins) or n > s.length]:
            self.forget(s, s.checkpoints.pop(n))

    # -- prefix snapshots ----------------------------------------------------------------------

    def snapshot_lengths(self, first: int, end: int) -> list[int]:
        """The page boundaries in (first, end) where a canonical pass keeps the state."""
        ps = self.page_size
        return list(range((first // ps + 1) * ps, end, ps))[:SNAPSHOTS_PER_PASS]

    def snapshot(self, s: _Seq, length: int, key: int) -> None:
        """Keep the state after ``length`` rows as the snapshot of the page indexed under ``key``:
        the checkpoint the pass kept there, or a copy of the current state."""
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return
        if length in s.checkpoints and length not in s.pins and s.checkpoints[length] != s.state:
            self.snapshots[key] = s.checkpoints.pop(length)
        elif length == s.length and s.state is not None:
            try:
                slot = self.allocate()
            except OutOfStates:
                return                     # no room: that prefix is just not reusable
            self.copies.append((s.state, slot))
            self.snapshots[key] = slot

    def copy_snapshot(self, key: int) -> int:
        """A copy of the snapshot of ``key``, for a pass that reuses the pages up to it to read."""
        self.snapshots.move_to_end(key)
        slot = self.allocate(keep=key)
        self.copies.append((self.snapshots[key], slot))
        return slot

    # -- slots ---------------------------------------------------------------------------------

    def allocate(self, keep: int | None = None) -> int:
        """A state slot; when none is free, the least recently used snapshot (not ``keep``'s) gives its own."""
        if not self.pool.free:
            for key in self.snapshots:
                if key != keep:
                    self.pool.release(self.snapshots.pop(key))
                    break
        return self.pool.allocate()

    def forget(self, s: _Seq, slot: int | None) -> None:
        """Release ``slot`` unless the sequence still holds it."""
        if slot is not None and slot not in self.slots_of(s):
            self.pool.release(slot)

    @staticmethod
    def slots_of(s: _Seq) -> set[int]:
        """Every slot the sequence holds: its state, its checkpoints, and its pass in flight's."""
        held = {s.state, *s.checkpoints.values(), *(s.pending.slots() if s.pending else ())}
        held.discard(None)
        return held

    def release(self, s: _Seq) -> None:
        """Give back every slot the sequence holds (it is freed or starts again empty)."""
        for slot in self.slots_of(s):
            self.pool.release(slot)
        s.state, s.pending = None, None
        s.checkpoints.clear()
        s.pins.clear()

    def stats(self) -> dict[str, int]:
        stats = self.pool.stats()
        return {**stats, "held": stats["held"] - len(self.snapshots), "snapshots": len(self.snapshots)}

    def check(self, live: dict[int, _Seq], evicted: Iterable[_Seq]) -> None:
        """Raise AssertionError unless the sequences' slots, the snapshots and the free list
        partition the slots, and each live sequence has a state exactly when it has rows."""
        every = [*live.values(), *evicted]
        self.pool.check([slot for s in every for slot in self.slots_of(s)] + list(self.snapshots.values()))
        for seq, s in live.items():
            if (s.state is None) != (s.length == 0):
                raise AssertionError(f"sequence {seq}: {s.length} rows but state slot {s.state}")
