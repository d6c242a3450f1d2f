"""Many inferlets to an inferlet host actor, on a two-node Ray cluster (ray.cluster_utils.Cluster):
the Controller packs processes into host actors up to `inferlets_per_actor` (and one actor each at
1), every result equals the same program's on Runtime.local, and a killed host actor fails exactly
the processes it hosted (test_cluster_full.py: a cluster with no room left). The dummy model: the
control plane is what is tested (test_inferlet_actor.py runs the real model, many runs to an actor)."""
from __future__ import annotations

import math

import pytest
import ray

from pie_actors import InferletError, Runtime
from pie_actors.config import ConfigError, load
from pie_actors.controller import INFERLET_PREFIX, NAME
from tests.cluster_helpers import DUMMY, HOLDER, ready, two_nodes, until

PROCESSES = 64
def _input(i: int) -> dict:
    return {"prompt": [1 + i, 2, 3 + i % 7, 4], "n": 6}


@pytest.fixture(scope="module")
def wants() -> list[dict]:
    """Each process's result on Runtime.local (no Ray)."""
    with Runtime.local(**DUMMY) as local:
        processes = [local.launch(HOLDER, _input(i)) for i in range(PROCESSES)]
        for p in processes:
            p.send("go")
        return [p.result(120) for p in processes]


@pytest.fixture(scope="module", params=[16, 1], ids=["16_per_actor", "1_per_actor"])
def cluster(request):
    with two_nodes() as (_, nodes, _), Runtime.connect(inferlets_per_actor=request.param, **DUMMY) as runtime:
        yield runtime, nodes, request.param


def _hosts(nodes: dict[str, str] | None = None) -> dict[str, list[tuple]]:
    """Every live inferlet host actor (Ray's named actors) -> the processes it runs; `nodes`, when
    given, gets each actor's node."""
    hosts = {}
    for name in ray.util.list_named_actors():
        if name.startswith(INFERLET_PREFIX):
            try:
                node, runs = ray.get(ray.get_actor(name).whereabouts.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                continue
            hosts[name] = [tuple(key) for key, _, _ in runs]
            if nodes is not None:
                nodes[name] = node
    return hosts


def _referenced(runtime: Runtime) -> int:
    return runtime.stats()["kv"]["referenced"]


def test_processes_pack_into_host_actors_near_their_engine_and_match_a_local_run(cluster, wants):
    runtime, _, per_actor = cluster
    processes = [runtime.launch(HOLDER, _input(i)) for i in range(PROCESSES)]
    ready(processes)                                          # all 64 live at once
    nodes: dict[str, str] = {}
    hosts = _hosts(nodes)
    used = [keys for keys in hosts.values() if keys]
    engine_node = runtime.stats()["replicas"][0]["node"]
    assert {nodes[name] for name, keys in hosts.items() if keys} == {engine_node}   # where its engine is
    assert sorted(k[1] for keys in used for k in keys) == sorted(p.name for p in processes)
    assert len(used) <= math.ceil(PROCESSES / per_actor)
    assert all(len(keys) <= per_actor for keys in used)
    spare = runtime.config.cluster.spare_actors
    assert len(hosts) <= math.ceil(PROCESSES / per_actor) + spare
    for p in processes:
        p.send("go")
    assert [p.result(300) for p in processes] == wants
    until(lambda: _referenced(runtime) == 0)


def test_a_name_is_free_again_once_its_result_is_back(cluster, wants):
    """The Controller forgets a process before its reader sees the end: a relaunch under the same
    name right after the result is placed, and the status lists no process that has ended."""
    runtime, _, _ = cluster
    for _ in range(4):
        p = runtime.launch(HOLDER, _input(0), name="again")
        p.send("go")
        assert p.result(120) == wants[0]
        status = ray.get(ray.get_actor(NAME).status.remote())
        assert "again" not in {s.name for s in status.processes}


def test_a_killed_host_actor_fails_exactly_its_processes(cluster, wants):
    """Its processes fail with the reason, but the restartable ones (every other one) run again from
    their start; the processes of other actors never notice; every page returns."""
    runtime, _, per_actor = cluster
    restartable = {i for i in range(2 * per_actor + 1) if i % 2}
    processes = [runtime.launch(HOLDER, {**_input(i), "restartable": i in restartable})
                 for i in range(2 * per_actor + 1)]
    ready(processes)
    victim, hosted = max(_hosts().items(), key=lambda item: len(item[1]))
    doomed = {k[1] for k in hosted}
    assert len(doomed) == per_actor                            # packed: the fullest actor is full
    ray.kill(ray.get_actor(victim))
    for i, p in enumerate(processes):
        if p.name not in doomed:
            continue
        if i in restartable:                                   # from its start, on another actor
            ready([p])
        else:
            with pytest.raises(InferletError, match="actor") as failed:
                p.result(60)
            assert failed.value.kind == "trap"
    going = [(i, p) for i, p in enumerate(processes) if p.name not in doomed or i in restartable]
    for _, p in going:
        p.send("go")
    assert [p.result(300) for _, p in going] == [wants[i] for i, _ in going]
    until(lambda: _referenced(runtime) == 0)                   # the dead actor's connections' pages too
    status = ray.get(ray.get_actor(NAME).status.remote())
    assert not {p.name for p in processes} & {p.name for p in status.processes}
    assert victim not in _hosts()                              # placed on no more


@pytest.mark.parametrize("setting", [dict(inferlets_per_actor=0), dict(inferlets_per_actor=-3),
                                     dict(spare_actors=-1), dict(actors_per_node=0)])
def test_cluster_settings_are_validated(setting):
    name = next(iter(setting))
    with pytest.raises(ConfigError, match=f"cluster.{name} must be at least"):
        load(**setting)
