"""The sandbox's instances in slots of wasmtime's pooling allocator (pie_actors/inferlet/instance_pool.py):
the same results as instances mapped anew, nothing of a run left for the next in its slot, the
pages a run writes kept for the next, and a clear error once every slot is taken."""
from __future__ import annotations

import gc
import resource
import statistics
import threading

import pytest

from pie_actors.config import RunLimits
from pie_actors.inferlet import HostApi, InferletError, Sandbox
from pie_actors.inferlet.build import new_engine

LIMITS = RunLimits(timeout_s=60, memory_mb=256)

SOURCE = """
import inferlet

async def main(input: dict) -> dict:
    left = getattr(inferlet, "left_by_a_run", None)          # what an earlier run set, if it lived on
    inferlet.left_by_a_run = input["n"]
    words = {f"w{i}": i * i for i in range(input["n"] * 100)}
    return {"n": len(words), "sum": sum(words.values()), "left": left}
"""


def _runs(sandbox: Sandbox, n: int) -> tuple[list[dict], list[int]]:
    """Results and minor page faults of `n` runs one after another on this thread."""
    results, faults = [], []
    for i in range(n):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        results.append(sandbox.run(SOURCE, {"n": i}))
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    return results, faults


def test_pooled_runs_equal_fresh_ones_leave_nothing_behind_and_fault_fewer_pages():
    pooled, fresh = Sandbox(limits=LIMITS, engine=new_engine()), Sandbox(limits=LIMITS, engine=new_engine(slots=0))
    results, pooled_faults = _runs(pooled, 8)
    assert results == _runs(fresh, 8)[0]
    assert [r["left"] for r in results] == [None] * 8        # each run in a slot reset in place
    fresh_faults = _runs(fresh, 8)[1]
    # A fresh instance faults in every page of the memory image its run writes (hundreds); a slot
    # keeps them from the run before. Counted after the first run, which fills the slot.
    assert statistics.median(pooled_faults[1:]) < 0.5 * statistics.median(fresh_faults[1:]), \
        (pooled_faults, fresh_faults)


class _Gate(HostApi):
    """A host whose `wait` operation blocks until the test opens the gate."""

    def __init__(self, entered: threading.Semaphore, gate: threading.Event) -> None:
        super().__init__()
        self.entered, self.gate = entered, gate

    def call(self, op, args):
        if op == "wait":
            self.entered.release()
            self.gate.wait(30)
            return None
        return super().call(op, args)


WAITS = """
from inferlet import _host

async def main(input: dict) -> dict:
    _host.call("wait", None)
    return {"done": True}
"""


def test_a_run_past_the_pools_slots_fails_clearly_and_the_slots_come_back():
    sandbox = Sandbox(limits=LIMITS, engine=new_engine(slots=2))
    entered, gate = threading.Semaphore(0), threading.Event()
    results: list = []
    holders = [threading.Thread(target=lambda: results.append(sandbox.run(WAITS, {}, _Gate(entered, gate))))
               for _ in range(2)]
    for t in holders:
        t.start()
    for _ in holders:
        assert entered.acquire(timeout=30)                   # both instances are alive, in both slots
    with pytest.raises(InferletError) as e:
        sandbox.run(SOURCE, {"n": 1})
    assert e.value.kind == "limit" and "too many inferlets at once" in e.value.message
    gate.set()
    for t in holders:
        t.join(30)
    assert results == [{"done": True}] * 2
    # the slots came back: two runs at once again, and the failed instantiation took none
    entered, gate = threading.Semaphore(0), threading.Event()
    holder = threading.Thread(target=lambda: results.append(sandbox.run(WAITS, {}, _Gate(entered, gate))))
    holder.start()
    assert entered.acquire(timeout=30)
    assert sandbox.run(SOURCE, {"n": 2})["n"] == 200
    gate.set()
    holder.join(30)


def test_a_run_that_times_out_gives_its_slot_back_at_once():
    sandbox = Sandbox(limits=RunLimits(timeout_s=0.5, memory_mb=256), engine=new_engine(slots=1))
    gc.disable()                     # no collection may free the slot: the run's end must
    try:
        with pytest.raises(InferletError) as e:
            sandbox.run("async def main(input):\n    while True:\n        pass\n", {})
        assert e.value.kind == "timeout"
        assert sandbox.run(SOURCE, {"n": 1})["n"] == 100
    finally:
        gc.enable()
