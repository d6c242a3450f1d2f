"""Recurrent-state slots: the fixed-size state a working set keeps for each linear-attention layer.

A model with recurrent layers (gpu/model/qwen3_5.py) keeps, besides the KV pages of its attention
layers, one state per working set: its size does not grow with the tokens. The engine holds the
state tensors, with one row per slot plus a last row of zeros (`zero`: the state of no tokens);
this pool only hands slot numbers out. A slot has exactly one holder: a working set's current
state, the state a pass in flight is writing for it, or one of its checkpoints.
"""

from collections import deque
from dataclasses import dataclass

from .pool import OutOfPages


@dataclass
class StatePass:
    """The states a pass in flight writes for one sequence: `dst` after its rows, `saves` on the
    way (length -> slot); `rewound`: (start, rows) its explicit slots took back from the sequence."""

    dst: int | None
    saves: dict[int, int]
    rewound: tuple[int, list[int | None]] | None = None
    src: int | None = None        # a prefix hit's snapshot, copied for this pass to read

    def slots(self) -> list[int]:
        return [slot for slot in (self.dst, self.src) if slot is not None] + list(self.saves.values())


class OutOfStates(OutOfPages):
    """Every recurrent-state slot is held; the failed call changed nothing."""


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.free: deque[int] = deque(range(num_slots))

    @property
    def zero(self) -> int:
        """The read-only slot of zeros: the state of an empty working set."""
        return self.num_slots

    def allocate(self) -> int:
        if not self.free:
            raise OutOfStates(f"all {self.num_slots} recurrent-state slots are held")
        return self.free.popleft()

    def release(self, slot: int | None) -> None:
        if slot is not None:
            self.free.append(slot)

    def stats(self) -> dict[str, int]:
        return {"total": self.num_slots, "free": len(self.free), "held": self.num_slots - len(self.free)}

    def check(self, held: list[int]) -> None:
        """Raise AssertionError unless `held` (every holder's slots) and the free list partition the slots."""
        seen = list(self.free) + held
        if sorted(seen) != list(range(self.num_slots)):
            twice = sorted({s for s in seen if seen.count(s) > 1})
            lost = sorted(set(range(self.num_slots)) - set(seen))
            raise AssertionError(f"recurrent-state slots held twice or free and held: {twice}; lost: {lost}")
