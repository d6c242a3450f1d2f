"""The Controller: engines by model, a warm pool of inferlet actors, launches on a Ray cluster."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from pie_actors.controller import connect, run_on_cluster
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
