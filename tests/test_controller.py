"""The Controller: engines by model, a warm pool of inferlet actors, launches on a Ray cluster."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from pie_actors.controller import connect, run_on_cluster
from pie_actors.inferlet.actor import bundle_files
from pie_actors.inferlet.host import InferletError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
QUICKSTART = (EXAMPLES / "quickstart" / "main.py").read_text()
COMPLETION = (EXAMPLES / "completion" / "main.py").read_text()
PROMPTS = ["The capital of France is", "Water boils at", "The quick brown fox", "My favourite book is"]


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    model = str(default_model_dir)
    yield lambda source, input, **kw: run_on_cluster(source, input, model, dtype="float32", **kw)
    ray.shutdown()


def test_quickstart_through_the_controller(cluster):
    sent = []
    out = cluster(QUICKSTART, {"question": "What is the capital of France?"}, on_send=sent.append)
    assert "Paris" in out["text"] and "".join(sent) == out["text"]
    status = ray.get(connect().status.remote())
    assert status["launches"] == 1 and len(status["engines"]) == 1


def test_warm_pool_hands_out_started_actors(cluster):
    controller = connect()
    cluster(COMPLETION, {"prompt": PROMPTS[0]})                     # the pool has refilled since
    # the actor hands itself back when its run ends, just after the client got the result
    _wait_for(lambda: not ray.get(controller.status.remote())["processes"])
    idle = ray.get(controller.__ray_call__.remote(lambda self: [a._actor_id.hex() for a in self.idle]))
    actor = ray.get(controller.acquire.remote())
    assert actor._actor_id.hex() in idle
    ray.get(controller.release.remote(actor))


def test_sixteen_concurrent_inferlets_get_their_alone_results(cluster, default_model_dir):
    prompts = (PROMPTS * 4)[:16]
    alone = {p: cluster(COMPLETION, {"prompt": p}) for p in PROMPTS}
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: cluster(COMPLETION, {"prompt": p}), prompts))
    assert together == [alone[p] for p in prompts]
    engine = ray.get(connect().__ray_call__.remote(lambda self: next(iter(self.engines.values()))[0]))
    stats = ray.get(engine.stats.remote())
    assert max(int(b) for b in stats["batch_sizes"]) > 1
    assert stats["kv"]["referenced"] == 0 and stats["sequences"] == 0


def test_a_failing_inferlet_raises_with_its_traceback(cluster):
    with pytest.raises(InferletError) as info:
        cluster("async def main(input):\n    return {'x': input['missing']}\n", {})
    assert info.value.kind == "exception" and "KeyError" in info.value.message
    assert "line 2" in info.value.guest_traceback


WAITER = """
from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()          # hold some KV pages while waiting
    fwd = ForwardPass()
    fwd.embed(chat.prefix() + model.encode("A long wait begins here"))
    fwd.state([ws])
    first = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    await first
    session.send("ready")
    return {"got": await session.receive(), "folded": ws.folded()}
"""

SENDER = """
from inferlet import session

async def main(input):
    session.send_to(input["to"], {"from": input["me"]})
    return {"sent": True}
"""


def _start(cluster, source, input, name=None):
    """Run in a thread; returns (future of the output, the process name once launched, sends)."""
    launched, sent = Future(), []

    def on_send(text):
        sent.append(text)
    pool = ThreadPoolExecutor(1)
    out = pool.submit(cluster, source, input, name=name, on_send=on_send, on_start=launched.set_result)
    pool.shutdown(wait=False)
    return out, launched.result(60), sent


def _wait_for(predicate, timeout=60.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _engine_stats():
    engine = ray.get(connect().__ray_call__.remote(lambda self: next(iter(self.engines.values()))[0]))
    return ray.get(engine.stats.remote())


def test_named_processes_take_messages_from_clients_and_each_other(cluster):
    out, name, sent = _start(cluster, WAITER, {}, name="waiter")
    assert name == "waiter"
    _wait_for(lambda: sent == ["ready"])
    status = ray.get(connect().status.remote())
    assert "waiter" in status["processes"]
    with pytest.raises(ValueError, match="already running"):
        cluster(SENDER, {"to": "x", "me": "y"}, name="waiter")
    assert cluster(SENDER, {"to": "waiter", "me": "sender"}) == {"sent": True}      # session.send_to
    result = out.result(60)
    assert result["got"] == {"from": "sender"} and result["folded"] > 0
    _wait_for(lambda: "waiter" not in ray.get(connect().status.remote())["processes"])
    with pytest.raises(InferletError, match="no running inferlet named 'waiter'"):
        cluster(SENDER, {"to": "waiter", "me": "late"})
    # a client message, through the Controller
    out, name, sent = _start(cluster, WAITER, {})
    _wait_for(lambda: sent == ["ready"])
    ray.get(connect().send.remote(name, "from the client"))
    assert out.result(60)["got"] == "from the client"


def test_killing_a_process_cancels_it_and_returns_its_pages(cluster):
    out, name, sent = _start(cluster, WAITER, {})
    _wait_for(lambda: sent == ["ready"])
    assert _engine_stats()["kv"]["referenced"] > 0
    ray.get(connect().kill.remote(name))
    with pytest.raises(InferletError) as info:
        out.result(60)
    assert info.value.kind == "cancelled" and name in info.value.message
    _wait_for(lambda: _engine_stats()["kv"]["referenced"] == 0 and _engine_stats()["sequences"] == 0)
    assert name not in ray.get(connect().status.remote())["processes"]


def test_files_and_bundles_travel_to_the_actor(cluster, tmp_path):
    (tmp_path / "helper.py").write_text("def shout(s):\n    return s.upper()\n")
    (tmp_path / "main.py").write_text("from inferlet import session\nfrom helper import shout\n\n"
                                      "async def main(input):\n"
                                      "    return {'text': shout(session.file('f').decode())}\n")
    out = cluster("", {}, files={"f": b"quiet"}, bundle=bundle_files(tmp_path))
    assert out == {"text": "QUIET"}
