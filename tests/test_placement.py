"""Engine placement: the Ray resources an engine's ranks ask for, and which replica a process uses."""
from __future__ import annotations

import pytest
import ray

from pie_actors.config import EngineConfig, load
from pie_actors.gpu.engine.actor import start_engine_actor
from pie_actors.placement import ReplicaView, choose_replica, engine_resources, replica_nodes, uses_gpus
from tests.engine_helpers import save_tiny_model


def test_cuda_ranks_ask_for_a_gpu_each_in_one_strict_pack_group():
    res = engine_resources(EngineConfig(device="cuda", tp=4), gpus=True)
    assert res.rank_options == {"num_cpus": 0, "num_gpus": 1}
    assert res.bundles == [{"GPU": 1}] * 4 and res.strategy == "STRICT_PACK"


def test_a_cpu_engine_asks_for_nothing_and_cpu_ranks_for_almost_nothing():
    one = engine_resources(EngineConfig(device="cpu"), gpus=False)
    assert one.rank_options == {"num_cpus": 0, "num_gpus": 0} and one.bundles == []
    two = engine_resources(EngineConfig(device="cpu", tp=2), gpus=False)
    assert two.rank_options["num_gpus"] == 0 and len(two.bundles) == 2
    assert all(0 < b["CPU"] < 1 for b in two.bundles)


def test_auto_device_follows_the_clusters_gpus():
    assert uses_gpus(EngineConfig(device="auto"), cluster_gpus=8)
    assert not uses_gpus(EngineConfig(device="auto"), cluster_gpus=0)
    assert uses_gpus(EngineConfig(device="cuda:1"), cluster_gpus=0)
    assert not uses_gpus(EngineConfig(device="cpu"), cluster_gpus=8)


def test_replicas_spread_one_per_node_that_fits():
    nodes = [{"NodeID": "b", "Alive": True, "Resources": {"CPU": 4, "GPU": 2}},
             {"NodeID": "a", "Alive": True, "Resources": {"CPU": 4, "GPU": 2}},
             {"NodeID": "head", "Alive": True, "Resources": {"CPU": 4}},
             {"NodeID": "dead", "Alive": False, "Resources": {"CPU": 4, "GPU": 8}}]
    gpu = engine_resources(EngineConfig(device="cuda", tp=2), gpus=True)
    assert replica_nodes(nodes, gpu, 3) == ["a", "b", "a"]          # the head has no GPU: none there
    cpu = engine_resources(EngineConfig(device="cpu"), gpus=False)
    assert replica_nodes(nodes, cpu, 3) == ["a", "b", "head"]
    assert replica_nodes(nodes, cpu, 1) == [None]                    # one replica: Ray places it


def test_replica_choice_local_then_prefix_then_least_loaded():
    views = [ReplicaView("a", cached_tokens=0, sequences=5), ReplicaView("b", cached_tokens=32, sequences=9),
             ReplicaView("c", cached_tokens=16, sequences=1)]
    assert choose_replica(views, "a") == (0, "local")
    assert choose_replica(views, "z") == (1, "prefix")
    cold = [ReplicaView("a", sequences=5), ReplicaView("b", sequences=2), ReplicaView("c", sequences=2)]
    assert choose_replica(cold, "z") == (1, "least_loaded")            # ties go to the first started
    two_local = [ReplicaView("a", sequences=3), ReplicaView("a", sequences=0, cached_tokens=0)]
    assert choose_replica(two_local, "a") == (1, "local")              # among local ones, the idler
    with pytest.raises(ValueError):
        choose_replica([], "a")


def test_a_tp2_engine_actor_and_its_rank_share_one_placement_group(tmp_path):
    folder = save_tiny_model("qwen3", tmp_path / "qwen3")     # 4 heads, 2 KV heads: splits over 2
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = load(model=str(folder), device="cpu", dtype="float32", compile="off", tp=2,
                      num_threads=1, kv_memory_mb=16).engine
        engine, address = start_engine_actor(config)
        placement = ray.get(engine.placement.remote())
        assert placement["rank0"] is not None and placement["ranks"] == [placement["rank0"]]
        table = ray.util.placement_group_table()[placement["rank0"]]
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
        assert address[0] not in ("0.0.0.0", "127.0.0.1") and address[0] == ray.util.get_node_ip_address()
        ray.get(engine.close.remote())
    finally:
        ray.shutdown()
