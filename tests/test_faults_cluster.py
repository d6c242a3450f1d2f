"""Faults on a two-node Ray cluster (ray.cluster_utils.Cluster): an inferlet actor, an engine, the
Controller or a whole node dies. What was running there fails clearly and within seconds, never
hangs; everything else finishes exactly; KV pages come back; what Ray restarts serves again."""
from __future__ import annotations

import pytest
import ray

from pie_actors import Done, Failed, InferletError, Runtime, Send
from pie_actors.controller import INFERLET_PREFIX, NAME, NAMESPACE, ask
from pie_actors.replicas import ENGINE_PREFIX
from tests.cluster_helpers import DUMMY, GREEDY, WAITER, two_nodes, until

PROMPT = list(range(1, 40))
LONG = 400                      # tokens of a run that goes to its end
VICTIM = 1200                   # tokens a run that is killed mid-way would generate: far more than it
                                # gets to while the test finds its actor (two fit the dummy's 256 pages)


@pytest.fixture(scope="module")
def cluster():
    """The Runtime on the dummy model with one engine replica per node of the two, and an inferlet
    actor per process (`inferlets_per_actor = 1`: a crash boundary each; test_host_actors.py kills
    an actor that hosts many)."""
    with two_nodes() as (cluster, ids, worker), \
            Runtime.connect(replicas=2, inferlets_per_actor=1, spare_actors=2, **DUMMY) as runtime:
        yield runtime, ids, cluster, worker


def _engine_on(node: str):
    for name in ray.util.list_named_actors():
        if name.startswith(ENGINE_PREFIX) and name.endswith(":dummy"):
            actor = ray.get_actor(name)
            if ray.get(actor.node.remote(), timeout=60) == node:
                return actor
    raise LookupError(f"no engine on {node}")


def _actor_of(process_name: str):
    """The inferlet actor running `process_name` (each actor says what it runs)."""
    for name in ray.util.list_named_actors():
        if name.startswith(INFERLET_PREFIX):
            actor = ray.get_actor(name)
            try:
                if (None, process_name) in [key for key, _, _ in ray.get(actor.whereabouts.remote(), timeout=10)[1]]:
                    return actor
            except ray.exceptions.RayActorError:
                continue
    raise LookupError(process_name)


def _referenced(engine) -> int:
    return ray.get(engine.stats.remote(), timeout=60)["kv"]["referenced"]


def _status():
    """The Controller's status (asked again while Ray restarts it, as the runtime does)."""
    return ask(ray.get_actor(NAME, namespace=NAMESPACE), "status")


def _first_sends(process, n: int) -> None:
    events = process.events(timeout=60)
    for _ in range(n):
        assert isinstance(next(events), Send)


def test_a_killed_inferlet_actor_fails_its_process_and_returns_its_pages(cluster):
    runtime, nodes, _, _ = cluster
    engine = _engine_on(nodes["a"])
    want = runtime.launch(GREEDY, {"prompt": [5, 6, 7], "n": 24}, node=nodes["a"]).result(timeout=120)
    start = _referenced(engine)
    victim = runtime.launch(GREEDY, {"prompt": PROMPT, "n": VICTIM}, node=nodes["a"])
    other = runtime.launch(GREEDY, {"prompt": [5, 6, 7], "n": 24}, node=nodes["a"])
    _first_sends(victim, 3)
    ray.kill(_actor_of(victim.name))
    with pytest.raises(InferletError, match="actor") as failed:     # within result's own deadline
        victim.result(timeout=30)
    assert failed.value.kind == "trap"
    assert other.result(timeout=120) == want                           # its neighbour, exactly
    until(lambda: _referenced(engine) == start)                       # the dropped connection's pages
    until(lambda: victim.name not in [p.name for p in _status().processes])
    until(lambda: _status().free_room >= 2)                        # the spare room refilled


def test_a_killed_engine_fails_its_programs_and_restarts_for_new_ones(cluster):
    runtime, nodes, _, _ = cluster
    engine = _engine_on(nodes["b"])
    want = runtime.launch(GREEDY, {"prompt": [9, 8, 7], "n": 12}, node=nodes["b"]).result(timeout=120)
    before = ray.get(engine.address.remote())
    running = [runtime.launch(GREEDY, {"prompt": PROMPT, "n": VICTIM}, node=nodes["b"]) for _ in range(2)]
    for p in running:
        _first_sends(p, 2)
    ray.kill(engine, no_restart=False)                                 # Ray restarts it (max_restarts)
    for p in running:
        end = [e for e in p.events(timeout=60)][-1]
        # the host's typed error, raised in the inferlet (which does not catch it)
        assert isinstance(end, Failed) and "ConnectionLost: the engine connection was lost: the connection to the engine" in end.message, end
    again = runtime.launch(GREEDY, {"prompt": [9, 8, 7], "n": 12}, node=nodes["b"])
    assert again.result(timeout=180) == want                           # the restarted engine, its new port
    after = ray.get(engine.address.remote(), timeout=60)
    assert (after.host, after.port) != (before.host, before.port)
    until(lambda: _referenced(engine) == 0)


def test_a_restartable_program_runs_again_after_its_engine_restarts_with_the_same_output(cluster):
    runtime, nodes, _, _ = cluster
    restartable = GREEDY.replace("async def main(input):\n",
                                   "async def main(input):\n    runtime.declare_restartable()\n"
                                   ).replace("import session", "import runtime, session")
    want = runtime.launch(restartable, {"prompt": PROMPT, "n": LONG}, node=nodes["b"]).result(timeout=180)
    process = runtime.launch(restartable, {"prompt": PROMPT, "n": LONG}, node=nodes["b"])
    _first_sends(process, 2)
    ray.kill(_engine_on(nodes["b"]), no_restart=False)
    events = list(process.events(timeout=180))
    assert isinstance(events[-1], Done) and events[-1].output == want, events[-1]   # greedy: the same tokens
    sends = [e for e in events if isinstance(e, Send)]
    # the second run's from its start (the first run's two read above are not in `events`; more of its
    # own may follow them before the kill lands)
    assert len(sends) >= LONG and [e.text for e in sends[-LONG:]] == [str(t) for t in want["tokens"]]
    until(lambda: _referenced(_engine_on(nodes["b"])) == 0)


def test_a_killed_controller_restarts_and_finds_its_engines_and_processes(cluster):
    runtime, nodes, _, _ = cluster
    waiter = runtime.launch(WAITER, {"prompt": PROMPT}, node=nodes["a"])
    assert next(iter(waiter.events(timeout=60))).text == "ready"
    engines = _status().replicas["dummy"]
    ray.kill(ray.get_actor(NAME, namespace=NAMESPACE), no_restart=False)
    # the new instance is the one that has launched nothing yet
    until(lambda: _status().launches == 0, timeout=120)
    status = _status()
    assert [r.node for r in status.replicas["dummy"]] == [r.node for r in engines]
    assert waiter.name in [p.name for p in status.processes]     # asked of the live actors
    waiter.send("still here")                                          # the run never noticed
    assert waiter.result(timeout=60)["got"] == "still here"
    until(lambda: waiter.name not in [p.name for p in _status().processes])
    assert runtime.launch(GREEDY, {"prompt": [1, 2], "n": 3}).result(timeout=120)["tokens"]


# says "ready" before any pass, waits for a message, then runs GREEDY as a child of its own
SPAWNER = """
from inferlet import runtime, session

async def main(input):
    session.send("ready")
    await session.receive()
    child = await runtime.spawn(input["child"], {"prompt": input["prompt"], "n": 3})
    return await child.result()
"""


def test_a_restarted_controller_knows_the_model_of_a_process_before_its_first_pass(cluster):
    """A process on a node without a replica has its engine chosen at its first pass (a
    FirstPassChoice). A Controller that restarts before that pass learns its model from its actor,
    so the child it spawns then runs on that model's engine."""
    runtime, nodes, c, _ = cluster
    want = runtime.launch(GREEDY, {"prompt": [4, 5, 6], "n": 3}, node=nodes["a"]).result(timeout=120)
    node_c = c.add_node(num_cpus=1, resources={"node_c": 1})
    c.wait_for_nodes()
    try:
        on_c = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_c" in n["Resources"])
        spawner = runtime.launch(SPAWNER, {"prompt": [4, 5, 6], "child": GREEDY}, node=on_c)
        assert next(iter(spawner.events(timeout=60))).text == "ready"
        ray.kill(ray.get_actor(NAME, namespace=NAMESPACE), no_restart=False)
        until(lambda: _status().launches == 0, timeout=120)
        assert {p.name: p.model for p in _status().processes}[spawner.name] == "dummy"
        spawner.send("go")
        assert spawner.result(timeout=120) == want
    finally:
        c.remove_node(node_c)


def test_a_lost_node_fails_its_programs_and_the_other_node_goes_on(cluster):
    runtime, nodes, c, worker = cluster
    engine_a = _engine_on(nodes["a"])
    start = _referenced(engine_a)
    on_a = runtime.launch(WAITER, {"prompt": PROMPT}, node=nodes["a"])
    on_b = runtime.launch(WAITER, {"prompt": PROMPT}, node=nodes["b"])
    for p in (on_a, on_b):
        assert next(iter(p.events(timeout=60))).text == "ready"
    c.remove_node(worker)
    end = [e for e in on_b.events(timeout=60)][-1]
    assert isinstance(end, Failed) and end.kind == "trap", end          # its actor went with the node
    on_a.send("go on")
    assert on_a.result(timeout=60)["got"] == "go on"
    until(lambda: _referenced(engine_a) == start)
    # a new program runs on node a's engine (b's died with its node: Ray cannot restart it there)
    assert runtime.launch(GREEDY, {"prompt": [3, 4], "n": 3}, node=nodes["a"]).result(timeout=180)["tokens"]
