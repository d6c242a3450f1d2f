"""Two Ray nodes on this machine for the cluster tests, and the programs they run."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import ray
from ray.cluster_utils import Cluster

from pie_actors.controller import NAMESPACE

# greedy decoding of token ids, each new token also streamed (session.send)
GREEDY = """
from inferlet import session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    tokens, ws, pipe, done = list(input["prompt"]), WorkingSet(), Pipeline(), 0
    for _ in range(input["n"]):
        fwd = ForwardPass()
        fwd.embed(tokens[done:])
        fwd.state([ws], StateGeometry.folding())
        out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await out)
        session.send(str(tokens[-1]))
    pipe.close()
    return {"tokens": tokens[len(input["prompt"]):]}
"""
# prefills its prompt into a working set it holds, says "ready", and waits for a message
WAITER = """
from inferlet import session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(list(input["prompt"]))
    fwd.state([ws], StateGeometry.folding())
    first = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    await first
    session.send("ready")
    return {"got": await session.receive()}
"""
DUMMY = dict(model="dummy", device="cpu", dtype="float32", compile="off", num_pages=256, num_threads=1)


@contextmanager
def two_nodes() -> Iterator[tuple[Cluster, dict[str, str], object]]:
    """(the Cluster, node ids by letter, node b's handle): node "a" is the head, "b" a worker, one
    CPU each, told apart by a custom resource; this process is its driver (namespace "pie")."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                            "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        ids = {key[-1]: n["NodeID"] for n in ray.nodes() for key in n["Resources"] if key in ("node_a", "node_b")}
        yield cluster, ids, worker
    finally:
        ray.shutdown()
        cluster.shutdown()


def until(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)
