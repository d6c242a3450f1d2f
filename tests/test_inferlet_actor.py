"""Inferlets in Ray actors against an engine actor: streaming, concurrency, isolation, no torch."""
from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from pie_actors import Done, Failed, Program, RunLimits, Send
from pie_actors.config import load
from pie_actors.gpu.engine.actor import start_engine_actor
from pie_actors.inferlet.actor import inferlet_actor
from pie_actors.launch import Launch

QUICKSTART = Program.load(Path(__file__).resolve().parent.parent / "examples/quickstart/main.py")


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine, address = start_engine_actor(load(model=str(default_model_dir), dtype="float32", compile="off").engine)
    actors = [inferlet_actor().remote() for _ in range(4)]
    ray.get([a.ready.remote() for a in actors])
    yield engine, address, actors
    ray.shutdown()


_names = itertools.count()


def _run(actor, program, input: dict, address, limits: RunLimits = RunLimits()) -> tuple[list[str], Done | Failed]:
    """(streamed messages, final event) of one run, read from the actor's event stream (lists of
    the events that arrived together)."""
    launch = Launch(Program.load(program), input, limits=limits, name=f"run-{next(_names)}")
    events = [e for ref in actor.run.remote(launch, address) for e in ray.get(ref)]
    assert all(isinstance(e, Send) for e in events[:-1])
    return [e.text for e in events[:-1]], events[-1]


def test_quickstart_streams_from_an_actor(cluster):
    _, address, actors = cluster
    sent, last = _run(actors[0], QUICKSTART, {"question": "What is the capital of France?"}, address)
    assert len(sent) > 1, "text should arrive token by token"
    assert "".join(sent) == last.output["text"] and "Paris" in last.output["text"]


def test_concurrent_actors_are_batched_and_a_failure_stays_alone(cluster):
    engine, address, actors = cluster
    questions = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?"]
    alone = [_run(actors[0], QUICKSTART, {"question": q}, address)[1] for q in questions]
    before = ray.get(engine.stats.remote())["kv"]["referenced"]
    bad = "async def main(input):\n    raise RuntimeError('boom ' + input['tag'])\n"
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(_run, a, QUICKSTART, {"question": q}, address) for a, q in zip(actors, questions)]
        failed = pool.submit(_run, actors[3], bad, {"tag": "x1"}, address)
        assert [f.result()[1] for f in good] == alone
        _, error = failed.result()
    assert error.kind == "exception" and "boom x1" in error.message
    assert "line 2" in error.traceback
    stats = ray.get(engine.stats.remote())
    assert max(int(b) for b in stats["batch_sizes"]) > 1
    assert stats["kv"]["referenced"] == before            # every page of every run came back


def test_inferlet_actors_do_not_import_torch(cluster):
    _, address, actors = cluster
    _run(actors[1], QUICKSTART, {"question": "Hi"}, address)        # after a whole run, too
    loaded = ray.get(actors[1].__ray_call__.remote(lambda self: "torch" in __import__("sys").modules))
    assert loaded is False


LOOPS = "async def main(input):\n    while True:\n        pass\n"
TRAPS = "import sys\nsys.setrecursionlimit(10 ** 8)\n\ndef down(n):\n    return down(n + 1) + 1\n\nasync def main(input):\n    down(0)\n"
HUNGRY = "async def main(input):\n    hoard = []\n    while True:\n        hoard.append(bytearray(1 << 20))\n"


def test_one_actor_hosts_many_runs_and_a_bad_one_ends_alone(cluster):
    """A looping, a trapping and a memory-hungry inferlet share one actor with good ones: each bad
    one ends alone, with its own reason, and its neighbours' outputs equal their runs alone."""
    engine, address, actors = cluster
    host = actors[2]
    questions = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hi."]
    alone = [_run(host, QUICKSTART, {"question": q}, address)[1] for q in questions]
    before = ray.get(engine.stats.remote())["kv"]["referenced"]
    bounded = RunLimits(timeout_s=4, memory_mb=64)
    with ThreadPoolExecutor(8) as pool:
        good = [pool.submit(_run, host, QUICKSTART, {"question": q}, address) for q in questions]
        bad = {kind: pool.submit(_run, host, source, {}, address, bounded)
               for kind, source in (("loops", LOOPS), ("traps", TRAPS), ("hungry", HUNGRY))}
        assert [f.result()[1] for f in good] == alone
        ends = {kind: f.result()[1] for kind, f in bad.items()}
    assert ends["loops"].kind == "timeout", ends["loops"]
    assert ends["traps"].kind == "trap" and "call stack" in ends["traps"].message, ends["traps"]
    assert ends["hungry"].kind == "memory", ends["hungry"]
    assert ray.get(host.whereabouts.remote())[1] == []          # every run has left the actor
    assert ray.get(engine.stats.remote())["kv"]["referenced"] == before
