"""Inferlets in Ray actors against an engine actor: streaming, concurrency, isolation, no torch."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from pie_actors.gpu.engine.actor import start_engine_actor
from pie_actors.inferlet.actor import inferlet_actor

QUICKSTART = (Path(__file__).resolve().parent.parent / "examples/quickstart/main.py").read_text()


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine, address = start_engine_actor(str(default_model_dir), dtype="float32", num_threads=2)
    actors = [inferlet_actor().remote() for _ in range(4)]
    ray.get([a.ready.remote() for a in actors])
    yield engine, address, actors
    ray.shutdown()


def _run(actor, source: str, input: dict, address) -> tuple[list[str], dict]:
    """(streamed messages, final event) of one run."""
    sent, last = [], None
    for ref in actor.run.remote(source, input, address):
        event = ray.get(ref)
        if "send" in event:
            sent.append(event["send"])
        else:
            last = event
    return sent, last


def test_quickstart_streams_from_an_actor(cluster):
    _, address, actors = cluster
    sent, last = _run(actors[0], QUICKSTART, {"question": "What is the capital of France?"}, address)
    assert len(sent) > 1, "text should arrive token by token"
    assert "".join(sent) == last["result"]["text"] and "Paris" in last["result"]["text"]


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
    assert error["error"]["kind"] == "exception" and "boom x1" in error["error"]["message"]
    assert "line 2" in error["error"]["traceback"]
    stats = ray.get(engine.stats.remote())
    assert max(int(b) for b in stats["batch_sizes"]) > 1
    assert stats["kv"]["referenced"] == before            # every page of every run came back


def test_inferlet_actors_do_not_import_torch(cluster):
    _, address, actors = cluster
    _run(actors[1], QUICKSTART, {"question": "Hi"}, address)        # after a whole run, too
    loaded = ray.get(actors[1].__ray_call__.remote(lambda self: "torch" in __import__("sys").modules))
    assert loaded is False
