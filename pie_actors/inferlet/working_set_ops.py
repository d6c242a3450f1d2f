"""The `ws.*` host operations (`WorkingSetOps`): working sets, forked, saved, opened and freed.

A working set's handle is the run's own small integer, mapped to the engine's sequence (None
until the engine is chosen: engine_link.py). Its passes (pass_ops.py) count it busy until they
have run: a fork or a save waits for them, and a set the guest drops while busy is freed after
them. Saved working sets (`ws.save`, `ws.open`) are named in the scope of the run's `owner`,
which the guest cannot choose.
"""
from __future__ import annotations

import itertools
import threading
from collections import Counter
from typing import Any

from typing_extensions import TypedDict

from .engine_client import EngineClient
from .engine_link import EngineLink
from .host import HostOpError
from .host_op import Handle, Name, host_op, shape

__all__ = ["WorkingSetOps"]

FORK_WAIT_S = 600.0     # how long ws.fork waits for the parent's passes to run (within the run's deadline)


@shape
class Reserve(TypedDict):
    handle: int
    end: int


@shape
class Save(TypedDict):
    handle: int
    name: str


@shape
class Handles(TypedDict):
    handles: list[int]


class WorkingSetOps:
    interface = "working-sets"

    def __init__(self, link: EngineLink, owner: str | None = None) -> None:
        self.link, self.run, self.owner = link, link.run, owner
        self._ws: dict[int, int | None] = {}              # working-set handle -> engine sequence
        self._ws_ids = itertools.count(1)
        self._busy: Counter[int] = Counter()              # working-set handle -> passes not finished
        self._dropped: set[int] = set()                   # handles the guest dropped while busy
        self._busy_cond = threading.Condition()

    def seq(self, handle: int) -> int:
        """The engine sequence of working set `handle` (one made before the engine was chosen
        makes the choice now)."""
        if handle not in self._ws:
            raise HostOpError(f"unknown working set {handle!r}")
        return self.link.engine_id(self._ws, handle, "working set")

    def _new_ws(self, seq: int | None) -> int:
        handle = next(self._ws_ids)
        self._ws[handle] = seq
        return handle

    @host_op("ws.create")
    def create(self) -> int:
        handle = self._new_ws(None)

        async def create(client: EngineClient) -> None:
            if handle in self._ws:                         # not freed meanwhile
                self._ws[handle] = await client.create()
        try:
            self.link.now_or_later(create)
        except HostOpError:
            del self._ws[handle]
            raise
        return handle

    @host_op("ws.fork", Handle)
    def fork(self, handle: int) -> int:
        """A child sharing the prefix the parent has once its passes submitted so far have run."""
        return self._new_ws(self.run.wait(self.link.client().fork(self._settled(handle, "fork"))))

    def _settled(self, handle: int, what: str) -> int:
        """The working set's sequence, once the passes submitted on it so far have run."""
        seq = self.seq(handle)
        self.run.flush()                          # the passes to wait for go out first
        with self._busy_cond:
            if not self._busy_cond.wait_for(lambda: not self._busy[handle], self.run.time_left(FORK_WAIT_S)):
                self.run.time_left(FORK_WAIT_S)      # the run's deadline passed: its timeout
                raise HostOpError(f"{what}: the working set's passes did not finish in {FORK_WAIT_S:.0f} s")
        return seq

    @host_op("ws.state", Handle)
    def state(self, handle: int) -> dict[str, Any]:
        return self.run.wait(self.run.client.state(self.seq(handle)))

    @host_op("ws.reserve", Reserve, wire="list")
    def reserve(self, handle: int, end: int) -> None:
        self.run.wait(self.run.client.reserve(self.seq(handle), end))

    @host_op("ws.save", Save, wire="list")
    def save(self, handle: int, name: str) -> int:
        """Keep the working set's frozen prefix, as it is once its passes ran, under `name` beyond
        this run; returns its number of tokens."""
        seq = self._settled(handle, "save")
        return self.run.wait(self.run.client.save(seq, name, self.owner))

    @host_op("ws.open", Name)
    def open(self, name: str) -> dict[str, Any]:
        """A new working set holding the saved set `name`: {"ws", "restored", "tokens"}."""
        opened = self.run.wait(self.link.client().open(name, self.owner))
        return {"ws": self._new_ws(opened["seq"]), "restored": opened["restored"], "tokens": opened["tokens"]}

    @host_op("ws.saved")
    def saved(self) -> list[dict[str, Any]]:
        return self.run.wait(self.link.client().saved(self.owner))

    @host_op("ws.delete_saved", Name)
    def delete_saved(self, name: str) -> None:
        self.run.wait(self.link.client().delete_saved(name, self.owner))

    @host_op("ws.free", Handles)
    def free(self, handles: list[int]) -> None:
        """The guest dropped these working sets: free each once its passes have run."""
        with self._busy_cond:
            idle = [h for h in handles if h in self._ws and not self._busy[h]]
            self._dropped.update(h for h in handles if h in self._ws and self._busy[h])
        for handle in idle:
            if self._ws[handle] is None:          # never sent to the engine
                del self._ws[handle]
            else:
                self.run.post(self._free_now, handle)

    def _free_now(self, handle: int) -> None:
        # loop thread, FIFO after every pass already submitted on it
        seq = self._ws.pop(handle, None)
        if seq is not None:
            self.run.client.start_free(seq)

    def hold(self, handles: list[int]) -> None:
        """A pass on these working sets was submitted: busy until `release`."""
        with self._busy_cond:
            self._busy.update(handles)

    def release(self, handles: list[int]) -> None:
        """A pass on these working sets finished (loop thread)."""
        with self._busy_cond:
            self._busy.subtract(handles)
            free = [h for h in handles if h in self._dropped and not self._busy[h]]
            self._dropped.difference_update(free)
            self._busy_cond.notify_all()
        for handle in free:
            self._free_now(handle)
