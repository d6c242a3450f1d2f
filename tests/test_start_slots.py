"""Start slots: a burst of runs in one process starts a few a core at a time (host._STARTS), so the
event loop that answers their engine handshakes is not starved; a slot returns however its run
ends, and a run that computes before it first waits holds up the others' starts only briefly."""
from __future__ import annotations

import threading

import pytest

from pie_actors.config import RunLimits
from pie_actors.inferlet import HostApi, InferletError, Sandbox, host

WAITS = """
import asyncio
from inferlet import _host

async def main(input: dict) -> dict:
    fid = _host.call("later", {"value": input["n"]})
    return {"n": await _host.future(fid)}
"""

LOOPS = """
async def main(input: dict) -> dict:
    while True:
        pass
"""

TRAPS = """
async def main(input: dict) -> dict:
    raise ValueError("before its first wait")
"""


class LaterHost(HostApi):
    """`later` answers with its value from another thread, after the run has begun to wait."""

    def call(self, op, args):
        if op != "later":
            return super().call(op, args)
        fid = self.futures.new()
        threading.Thread(target=self.futures.resolve, args=(fid, args["value"]), daemon=True).start()
        return fid


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(limits=RunLimits(timeout_s=60, memory_mb=256))


def _free_slots() -> int:
    return host._STARTS._value


def test_a_burst_of_runs_each_returns_its_slot(sandbox):
    full = _free_slots()
    results: dict[int, object] = {}

    def one(n: int) -> None:
        try:
            results[n] = sandbox.run(WAITS if n % 3 else TRAPS, {"n": n}, LaterHost())
        except InferletError as e:
            results[n] = e.kind

    threads = [threading.Thread(target=one, args=(n,)) for n in range(3 * full)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {n: ({"n": n} if n % 3 else "exception") for n in range(3 * full)}
    assert _free_slots() == full


def test_runs_that_compute_before_waiting_do_not_hold_up_a_neighbour(sandbox):
    """Every slot taken by a program that loops from its start: a neighbour still starts (after
    START_WAIT_S) and finishes while they loop; each looping run gives its slot back at its end."""
    full = _free_slots()
    loopers_done = threading.Event()
    ended: list[str] = []

    def loop() -> None:
        try:
            sandbox.run(LOOPS, {}, HostApi(), limits=RunLimits(timeout_s=20, memory_mb=256))
        except InferletError as e:
            ended.append(e.kind)
        if len(ended) == full:
            loopers_done.set()

    loopers = [threading.Thread(target=loop) for _ in range(full)]
    for t in loopers:
        t.start()
    assert sandbox.run(WAITS, {"n": 7}, LaterHost()) == {"n": 7}
    assert not loopers_done.is_set()              # it finished while every slot was still held
    for t in loopers:
        t.join()
    assert ended == ["timeout"] * full
    assert _free_slots() == full
