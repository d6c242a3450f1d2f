"""Inferlets in Ray actors against an engine actor: streaming, concurrency, isolation, no torch."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from pie_actors import Done, Failed, Program, RunLimits, Send
from pie_actors.config import load
from pie_actors.gpu.engine.actor import start_engine_actor
from pie_actors.inferlet.actor import inferlet_actor

QUICKSTART = Program.load(Path(__file__).resolve().parent.parent / "examples/quickstart/main.py")


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine, address = start_engine_actor(load(model=str(default_model_dir), dtype="float32", compile="off").engine)
    actors = [inferlet_actor().remote() for _ in range(4)]
    ray.get([a.ready.remote() for a in actors])
    yield engine, address, actors
    ray.shutdown()


def _run(actor, program, input: dict, address) -> tuple[list[str], Done | Failed]:
    """(streamed messages, final event) of one run, read from the actor's event stream."""
    events = [ray.get(ref) for ref in actor.run.remote(Program.load(program), input, address, RunLimits())]
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
