"""Two Ray nodes on this machine (ray.cluster_utils.Cluster): an engine replica per node, processes
on one node driving the engine on the other over the data plane, the replica each process uses
(its own node's, else by load), and KV pages back on both engines."""
from __future__ import annotations

from collections import Counter

import pytest
import ray

from pie_actors import Runtime
from pie_actors.gpu.engine import Engine
from pie_actors.replicas import ENGINE_PREFIX
from tests.cluster_helpers import DUMMY, FED, GREEDY, WAITER, two_nodes, until

DUMMY = {**DUMMY, "num_pages": 64}


@pytest.fixture(scope="module")
def cluster():
    with two_nodes() as (cluster, ids, _):
        yield cluster, ids


@pytest.fixture(scope="module")
def nodes(cluster):
    return cluster[1]


def _engines(model: str) -> list:
    return [ray.get_actor(n) for n in sorted(ray.util.list_named_actors()) if n.startswith(ENGINE_PREFIX)
            and n.endswith(":" + model)]


def _referenced(engines: list) -> list[int]:
    return [s["kv"]["referenced"] for s in ray.get([e.stats.remote() for e in engines])]


def _chosen(runtime: Runtime) -> list[Counter]:
    return [Counter(r["chosen"]) for r in runtime.stats()["replicas"]]


def test_replicas_one_per_node_and_each_process_uses_its_nodes(nodes):
    with Runtime.connect(replicas=2, **DUMMY) as runtime:
        replicas = runtime.stats()["replicas"]
        assert sorted(r["node"] for r in replicas) == sorted(nodes.values())      # one on each node
        engines = _engines("dummy")
        assert len(engines) == 2 and ray.get([e.node.remote() for e in engines]) == [r["node"] for r in replicas]
        start, chosen_before = _referenced(engines), _chosen(runtime)
        before = ray.get([e.stats.remote() for e in engines])
        for node in ("b", "a", "b"):
            out = runtime.launch(GREEDY, {"prompt": [1, 2, 3, 4, 5], "n": 4}, node=nodes[node]).result(timeout=120)
            assert len(out["tokens"]) == 4
        after = ray.get([e.stats.remote() for e in engines])
        chosen = {r["node"]: c - b for r, c, b in zip(replicas, _chosen(runtime), chosen_before)}
        assert chosen[nodes["b"]] == {"local": 2} and chosen[nodes["a"]] == {"local": 1}
        served = {r["node"]: a["requests"] - b["requests"] for r, a, b in zip(replicas, after, before)}
        assert served[nodes["b"]] > served[nodes["a"]] > 0         # each process's passes went to its node's
        until(lambda: _referenced(engines) == start)


def test_a_process_on_one_node_drives_the_engine_on_the_other_exactly(nodes, default_model_dir):
    settings = dict(model=str(default_model_dir), device="cpu", dtype="float32", compile="off", num_pages=128,
                    num_threads=1)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 15424, 8001, 418]]
    with Runtime.connect(**settings) as runtime:
        engine_node = runtime.stats()["replicas"][0]["node"]
        other = next(n for n in nodes.values() if n != engine_node)
        engines = _engines(str(default_model_dir))
        start = _referenced(engines)
        processes = [runtime.launch(GREEDY, {"prompt": p, "n": 10}, node=other) for p in prompts]
        got = [p.result(timeout=180)["tokens"] for p in processes]
        until(lambda: _referenced(engines) == start)
        host = runtime.stats()["replicas"][0]["address"][0]
        assert host not in ("127.0.0.1", "0.0.0.0") and host == ray.util.get_node_ip_address()
    direct = Engine.from_model(str(default_model_dir), device="cpu", dtype="float32", compile="off", num_pages=64)
    try:
        assert got == direct.generate(prompts, 10, ignore_eos=True)
    finally:
        direct.close()


def test_without_a_local_replica_the_first_pass_chooses_by_prefix_then_by_load(nodes, cluster):
    """Replicas on nodes a and b; node c, added later, has none. A process on c is launched with
    its engine not chosen: its first pass chooses the replica caching most of that pass's tokens,
    else the one with fewer live sequences, and then drives that replica alone, with the channels
    and epilogue it made before that pass (the same tokens as greedy decoding on a)."""
    cluster = cluster[0]
    with Runtime.connect(replicas=2, **DUMMY) as runtime:
        replicas = runtime.stats()["replicas"]
        on_a = next(i for i, r in enumerate(replicas) if r["node"] == nodes["a"])
        engines, chosen_before = _engines("dummy"), _chosen(runtime)
        start = _referenced(engines)
        node_c = cluster.add_node(num_cpus=1, resources={"node_c": 1})
        cluster.wait_for_nodes()
        c = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_c" in n["Resources"])
        try:
            prompt = list(range(1, 40))                     # two full pages of 16 and a tail
            waiter = runtime.launch(WAITER, {"prompt": prompt}, node=nodes["a"])
            assert next(iter(waiter.events())).text == "ready"          # it holds a working set on a's
            lighter = runtime.launch(GREEDY, {"prompt": [7, 8, 9], "n": 2}, node=c)
            assert len(lighter.result(timeout=120)["tokens"]) == 2
            before = [s["requests"] for s in ray.get([e.stats.remote() for e in engines])]
            follower = runtime.launch(FED, {"prompt": prompt, "n": 6}, node=c).result(timeout=120)["tokens"]
            after = [s["requests"] for s in ray.get([e.stats.remote() for e in engines])]
            waiter.send("go")
            assert waiter.result(timeout=60)["got"] == "go"
            greedy = runtime.launch(GREEDY, {"prompt": prompt, "n": 6}, node=nodes["a"]).result(timeout=120)
            assert follower == greedy["tokens"]
            chosen = [c - b for c, b in zip(_chosen(runtime), chosen_before)]
            assert chosen[on_a] == {"local": 2, "prefix": 1}          # a's holds the waiter's pages
            assert chosen[1 - on_a] == {"least_loaded": 1}            # the idle one, not a's (busy)
            a_engine = next(i for i, e in enumerate(engines) if ray.get(e.node.remote()) == nodes["a"])
            assert after[1 - a_engine] == before[1 - a_engine]         # the follower never reached b's
            assert after[a_engine] - before[a_engine] >= 3             # its requests went to a's
            until(lambda: _referenced(engines) == start)
        finally:
            cluster.remove_node(node_c)
