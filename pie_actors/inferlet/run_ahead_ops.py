"""The `eta.run_ahead*` host operations (`RunAheadOps`): a repeating pass and the reads that pace it.

A repeating pass stays on the engine, which runs it up to `window` times ahead of the reads the
guest acknowledged (`eta.run_ahead_ack`) until its budget is spent or the guest stops it
(`eta.run_ahead_stop`). It is sent like any pass (pass_ops.py); what it puts into channels is
pushed to the guest (channel_ops.py).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

from typing_extensions import NotRequired, TypedDict

from .channel_ops import ChannelOps
from .host import HostOpError
from .host_op import host_op, shape
from .pass_ops import Lane, Pass, PassOps

__all__ = ["RunAheadOps"]


@shape
class RunAhead(Pass):
    budget: int
    window: int
    wake_every: NotRequired[int]


@shape
class Ack(TypedDict):
    run: int
    read: int


@shape
class Stop(TypedDict):
    run: int
    keep: int | None


class RunAheadOps:
    interface = "run-ahead"

    def __init__(self, passes: PassOps, channels: ChannelOps) -> None:
        self.passes, self.channels, self.run = passes, channels, passes.run
        self._runs: dict[int, int] = {}                   # run-ahead handle -> its pass request id
        self._stopped: set[int] = set()                   # run-ahead handles the guest stopped
        self._run_ids = itertools.count(1)

    @host_op("eta.run_ahead", RunAhead)
    def run_ahead(self, lanes: list[Lane], budget: int, window: int, wake_every: int = 1,
                  epilogue: int | None = None, prologue: int | None = None,
                  adapters: list[tuple[str, int]] | None = None) -> dict[str, Any]:
        """Start a repeating pass: {"run": handle, "done": future id of the runs kept, "puts": the
        channels its epilogue puts into (what the guest read of them past a stop is dropped)}. With
        `wake_every` n > 1, a read of a channel its epilogue puts into that would wait waits until n
        values are there (or the run is over): the reader is woken once per n tokens, not each."""
        fields = self.passes.pass_fields(lanes, epilogue, prologue, adapters)
        if budget < 1 or window < 1:
            raise HostOpError("run_ahead needs a positive integer budget and window")
        if not 1 <= wake_every <= window:
            raise HostOpError(f"run_ahead's wake_every must be an integer from 1 to its window ({window})")
        fields["repeat"] = {"budget": budget, "window": window}
        puts = self.passes.puts.get(epilogue, set())
        handle, fid = next(self._run_ids), self.run.futures.new()
        self.channels.hold(puts, wake_every)

        def started(request_id: int) -> None:
            self._runs[handle] = request_id

        def done(fut) -> None:
            self._runs.pop(handle, None)
            self.channels.unhold(puts)
            # Once the guest has stopped, what is still unread came from runs past the stop (the
            # engine pushes every value before it answers). A run that ended by its budget keeps
            # its values: the guest may not have read them all yet.
            if handle in self._stopped:
                self._stopped.discard(handle)
                self.channels.clear(puts)
            self.passes.pass_done(fid, fut, int)

        self.passes.send_pass(fields, [lane["ws"] for lane in lanes], done, started)
        return {"run": handle, "done": fid, "puts": self.channels.handles(puts)}

    @host_op("eta.run_ahead_ack", Ack, wire="list")
    def ack(self, run: int, read: int) -> None:
        """The guest read `read` tokens: the engine may run further ahead (no reply awaited)."""
        self.run.post(self._tell_run, run, lambda pass_id: self.run.client.repeat_ack(pass_id, read))
        self.run.flush()     # at once: the guest may read on without turning its loop (take_scalar)

    @host_op("eta.run_ahead_stop", Stop, wire="list")
    def stop(self, run: int, keep: int | None) -> None:
        """Stop the run-ahead; runs after the first `keep` are cut off the working sets."""
        self._stopped.add(run)
        self.run.post(self._tell_run, run, lambda pass_id: self.run.client.repeat_stop(pass_id, keep))

    def _tell_run(self, handle: int, tell: Callable[[int], None]) -> None:
        # loop thread; FIFO after the run's start. A run that ended already needs nothing.
        pass_id = self._runs.get(handle)
        if pass_id is not None:
            tell(pass_id)
