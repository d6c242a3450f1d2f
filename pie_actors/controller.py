"""The Controller: a named, detached Ray actor that knows the engines, places processes on
inferlet host actors and names the running inferlets (processes): a process's `session.send_to`
looks its peer's actor up here once (`lookup`, owner-scoped) and then calls that actor itself.

A host actor runs up to `[cluster] inferlets_per_actor` processes at once (inferlet/actor.py). A
launch goes to the fullest host actor with room on its node (its own `node`, else one where the
model's engines run), so that the others empty and retire; the Controller keeps `spare_actors`
actors' worth of free room started ahead of launches (a new actor takes ~0.5-1 s, a launch into
free room one Ray call), and at most `actors_per_node` on a node.

`Runtime.connect()` (runtime.py) is its client: it asks for an engine (`engine`), then for each
launch a process name and a host actor (`launch`), and streams the run from the actor directly
(forward passes never touch the Controller). The actor reports back with `finished` when the run
ends, however it ends, and the runtime with `lost` when the run's stream broke. It is a plain
class underneath; `connect()` finds the running one or starts it.

A model's engines are its replicas (replicas.py): each launch gets the address of the one its
actor should use. Engines and inferlet actors are named and detached, so when Ray restarts a dead
Controller, the new one finds them again (engines by name, processes by asking each inferlet
actor what it runs) and running programs never notice.
"""
from __future__ import annotations

import itertools
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .config import ClusterConfig, EngineConfig
from .gpu.engine.wire import EngineAddress
from .inferlet.peers import Endings
from .launch import Launch, ProcessKey
from .placement import FirstPassChoice
from .replicas import Replicas, ReplicaStatus, ask_named

NAME, NAMESPACE = "pie_controller", "pie"
INFERLET_PREFIX = "pie_inferlet:"        # inferlet actor names: pie_inferlet:<uuid>
CONTROLLER_WAIT_S = 120.0                # the longest a call waits while Ray restarts the Controller
RETIRE_S = 5.0                           # a host actor empty this long, beyond the spare room, is retired


class UnknownProcess(KeyError):
    """No running inferlet has that name."""

    def __str__(self) -> str:
        return str(self.args[0])


class EngineMismatch(ValueError):
    """An engine for the model runs already, with other settings."""


@dataclass
class _Host:
    """An inferlet host actor as the Controller counts it."""

    actor: Any
    node: str                                   # its Ray node's id
    processes: set[ProcessKey] = field(default_factory=set)
    empty_since: float = 0.0                    # time.monotonic() when its last process ended


@dataclass(frozen=True)
class Placement:
    """Where the Controller put a launch: its process `name`, the host `actor` that runs it, and its
    `engine` (an address, or a FirstPassChoice that its first pass makes)."""

    name: str
    actor: Any
    engine: EngineAddress | FirstPassChoice


@dataclass
class _Process:
    host: _Host
    model: str | None                           # None: not known yet (found after a restart)
    started: float = field(default_factory=time.time)
    restartable: bool = False                   # it called runtime.declare_restartable


@dataclass(frozen=True)
class ProcessStatus:
    owner: str
    name: str
    model: str | None
    running_s: float


@dataclass(frozen=True)
class HostStatus:
    node: str                                   # its Ray node's id
    processes: int


@dataclass(frozen=True)
class ClusterStatus:
    """What `Controller.status` tells: engines by model (address; no secret), their replicas,
    processes, inferlet host actors, the free room in them (processes that fit without a new
    actor) and the launches so far."""

    engines: dict[str, tuple[str, int]]
    replicas: dict[str, list[ReplicaStatus]]
    processes: list[ProcessStatus]
    hosts: list[HostStatus]
    free_room: int
    launches: int


class Controller:
    def __init__(self, cluster: ClusterConfig | None = None):
        self.cluster = cluster or ClusterConfig()
        self.engines: dict[str, Replicas] = Replicas.find()     # model -> its engines (a restart finds them)
        self.hosts: dict[Any, _Host] = {}                       # actor id -> inferlet host actor
        self.processes: dict[ProcessKey, _Process] = {}
        self.endings = Endings()                                # how the ones that ended lately ended
        self.lost_restartable: set[ProcessKey] = set()          # forgotten with their dead host, to run again
        self.launches = 0
        self._numbers = itertools.count(1)
        self._find_hosts()
        self._keep_spare()

    def _find_hosts(self) -> None:
        """After a restart: the inferlet host actors still alive, and the processes they run."""
        for _, actor, (node, runs) in ask_named(INFERLET_PREFIX, "whereabouts"):
            host = self.hosts[actor._actor_id] = _Host(actor, node, empty_since=time.monotonic())
            for key, engine, model in runs:
                if model is None:                 # its engine is chosen: the model is that engine's
                    model = next((m for m, r in self.engines.items()
                                  if any(tuple(e.address[:2]) == engine for e in r.replicas)), None)
                key = tuple(key)
                host.processes.add(key)
                self.processes[key] = _Process(host, model)

    # ---- host actors -------------------------------------------------------------------------

    def _free_room(self) -> int:
        return sum(self.cluster.inferlets_per_actor - len(h.processes) for h in self.hosts.values())

    def _keep_spare(self) -> None:
        """Start host actors until `spare_room` processes more fit in them (they load in the
        background: a launch placed on one meanwhile waits in its queue, not on a new process),
        and retire the ones empty for RETIRE_S beyond twice that room."""
        while self._free_room() < self.cluster.spare_room:
            node = self._node_for_new(self._preferred_nodes(None))
            if node is None:
                break
            self._start_host(node)
        now = time.monotonic()
        for host in sorted(self.hosts.values(), key=lambda h: h.empty_since):
            if self._free_room() - self.cluster.inferlets_per_actor < 2 * self.cluster.spare_room:
                break
            if not host.processes and now - host.empty_since > RETIRE_S:
                import ray
                del self.hosts[host.actor._actor_id]
                ray.kill(host.actor)

    def _start_host(self, node: str) -> _Host:
        host = _Host(_new_actor(node), node, empty_since=time.monotonic())
        self.hosts[host.actor._actor_id] = host
        return host

    def _preferred_nodes(self, model: str | None) -> list[str]:
        """The nodes a process of `model` (None: of any model) should run on, the least loaded first:
        those of its engines (its passes then stay on the node), else every live node."""
        engines = [self.engines[model]] if model in self.engines else list(self.engines.values())
        nodes = list(dict.fromkeys(r.node for e in engines for r in e.replicas)) or _live_nodes()
        load = Counter(h.node for h in self.hosts.values() for _ in h.processes)
        return sorted(nodes, key=lambda n: load[n])

    def _node_for_new(self, nodes: list[str]) -> str | None:
        """The first of `nodes` that may start another host actor."""
        count = Counter(h.node for h in self.hosts.values())
        return next((n for n in nodes if count[n] < self.cluster.actors_per_node), None)

    def _place(self, node: str | None, model: str) -> _Host:
        """The host actor for a new process of `model` on `node` (None: the nodes of its engines,
        then any): the fullest one with room there, so that the others empty and retire; a new one
        when all are full."""
        nodes = [_node_id(node)] if node is not None else self._preferred_nodes(model)
        for n in nodes:
            room = [h for h in self.hosts.values()
                    if h.node == n and len(h.processes) < self.cluster.inferlets_per_actor]
            if room:
                return max(room, key=lambda h: len(h.processes))
        if node is None and (others := [n for n in _live_nodes() if n not in nodes]):
            nodes += others                        # its engines' nodes are full: the others before an error
        new = self._node_for_new(nodes)
        if new is None:
            where = f"node {node!r}" if node is not None else f"every node ({len(nodes)})"
            raise ClusterFull(f"no room for another inferlet: {where} runs its most inferlet host actors "
                              f"(cluster.actors_per_node = {self.cluster.actors_per_node}), each its most "
                              f"inferlets (cluster.inferlets_per_actor = {self.cluster.inferlets_per_actor})")
        return self._start_host(new)

    # ---- engines -----------------------------------------------------------------------------

    def engine(self, config: EngineConfig, long_lived: bool = True) -> tuple[Any, EngineAddress]:
        """The engine of `config.model` (its actor, and its data-plane address with the secret),
        started in the cluster on first use (`long_lived`: see `Engine.from_config`). Asking with
        other settings than the running engine's is an EngineMismatch: one engine per model, never
        reused silently for settings it does not have."""
        running = self.engines.get(config.model)
        if running is None:
            running = self.engines[config.model] = Replicas.start(config, long_lived)
        elif running.config != config:
            raise EngineMismatch(
                f"the cluster's engine for {config.model!r} runs with other settings: "
                f"{'; '.join(running.config.differences(config))}. Ask with its settings, or restart "
                "the cluster to change them")
        return running.first.actor, running.first.address

    # ---- processes ---------------------------------------------------------------------------

    def launch(self, launch: Launch, model: str, prefix: list[int] | None = None) -> Placement:
        """Place `launch`, a process of `model` (whose engine `engine` started): its name
        (`launch.name`, or one made up), the inferlet host actor it runs on (one with room on
        `launch.node`, else on a node of the model's engines), and the address of the replica it
        uses (on the actor's node, else the one caching most of `prefix`, the first pass's tokens,
        else the least loaded), or, when no replica runs on the actor's node and `prefix` is not
        given, a FirstPassChoice: the process's first pass asks `choose` with its tokens. The
        caller runs `actor.run.remote(<the named launch>, <that engine>, <this actor>)`. An engine
        that died and did not come back is an EngineGone; no room for the process is a ClusterFull."""
        owner, name = launch.owner, launch.name
        if name is not None and (owner, name) in self.processes:
            raise ValueError(f"a process named {name!r} is already running")
        if model not in self.engines:
            raise ValueError(f"no engine for {model!r} runs in this cluster (ask for it with `engine`)")
        name = name or f"inferlet-{next(self._numbers)}"
        while (owner, name) in self.processes:           # a user took that name before us
            name = f"inferlet-{next(self._numbers)}"
        host = self._place(launch.node, model)
        replicas = self.engines[model]
        at = host.node if len(replicas.replicas) > 1 else None
        if at is not None and prefix is None and not replicas.on(at):
            engine: EngineAddress | FirstPassChoice = FirstPassChoice(model, replicas.info())
        else:
            engine = replicas.choose(at, prefix, owner).address
        self.launches += 1
        host.processes.add((owner, name))
        self.processes[owner, name] = _Process(host, model)
        self._keep_spare()
        return Placement(name, host.actor, engine)

    def choose(self, model: str, node: str | None, prefix: list[int] | None, owner: str | None) -> EngineAddress:
        """The address of the replica of `model` for a process of `owner` on `node` whose first
        pass starts with `prefix` (a process launched with a FirstPassChoice asks at that pass)."""
        return self.engines[model].choose(node, prefix, owner).address

    def _forget(self, key: ProcessKey, how: str | None) -> _Host | None:
        process = self.processes.pop(key, None)
        if process is None:
            return None
        if how is not None:
            self.endings.note(key, how)
        process.host.processes.discard(key)
        if not process.host.processes:
            process.host.empty_since = time.monotonic()
        return process.host

    def declare_restartable(self, key: ProcessKey) -> None:
        """Process `key` may run again from its start if its host actor dies (its runtime relaunches it)."""
        if key in self.processes:
            self.processes[key].restartable = True

    def lost(self, key: ProcessKey, actor_died: bool = True) -> bool:
        """A process's stream broke (its runtime saw it): forget the name, and say whether the
        process declared itself restartable. `actor_died`: its host actor is gone, with every
        process it ran; it is placed on no more."""
        restartable = key in self.processes and self.processes[key].restartable
        if key in self.lost_restartable:           # its host's death was reported by a neighbour's runtime
            self.lost_restartable.discard(key)
            restartable = True
        host = self._forget(key, "was lost: its actor died" if actor_died else "was lost: its stream broke")
        if host is not None and actor_died:
            import ray
            for other in list(host.processes):
                if self.processes[other].restartable:
                    self.lost_restartable.add(other)
                self._forget(other, "was lost: its actor died")
            self.hosts.pop(host.actor._actor_id, None)
            ray.kill(host.actor)
            self._keep_spare()
        return restartable

    def finished(self, key: ProcessKey, how: str | None = None) -> None:
        """A process's run ended (its actor reports it, and `how`: peers.ending): forget the name."""
        if self._forget(key, how) is not None:
            self._keep_spare()

    def lookup(self, owner: str | None, name: str) -> Any:
        """The actor of `owner`'s running process `name` (for a `session.send_to` of that owner's
        process, which then calls it directly): another owner's process is not found."""
        process = self.processes.get((owner, name))
        if process is None:
            raise UnknownProcess(self.endings.not_running((owner, name), [n for o, n in self.processes if o == owner]))
        return process.host.actor

    def running(self, owner: str | None) -> int:
        """How many processes of `owner` run now."""
        return sum(o == owner for o, _ in self.processes)

    def engine_config(self, model: str | None, process: ProcessKey) -> EngineConfig:
        """The settings of the engine that runs `model` (None: the model of `process`), for a
        process that spawns a child on it."""
        if model is None:
            model = self.processes[process].model
        running = self.engines.get(model)
        if running is None:
            raise ValueError(f"no engine for {model!r} runs in this cluster (running: "
                             f"{', '.join(sorted(self.engines)) or 'none'})")
        return running.config

    def status(self) -> ClusterStatus:
        now = time.time()
        return ClusterStatus(
            engines={m: (r.first.address.host, r.first.address.port) for m, r in self.engines.items()},
            replicas={m: r.status() for m, r in self.engines.items()},
            processes=[ProcessStatus(o, n, p.model, round(now - p.started, 3)) for (o, n), p in self.processes.items()],
            hosts=[HostStatus(h.node, len(h.processes)) for h in self.hosts.values()],
            free_room=self._free_room(), launches=self.launches)


class ClusterFull(RuntimeError):
    """Every inferlet host actor is full, and no node may start another."""


def _live_nodes() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def _node_id(node: str) -> str:
    """The id of the live node whose id or IP is `node`."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for n in nodes:
        if node in (n["NodeID"], n["NodeManagerAddress"]):
            return n["NodeID"]
    known = ", ".join(f"{n['NodeID']} at {n['NodeManagerAddress']}" for n in nodes)
    raise ValueError(f"no live node {node!r} in this cluster (nodes: {known})")


def _new_actor(node: str) -> Any:
    """A new inferlet host actor on `node`, named and detached: it outlives a Controller that dies
    (its runs go on), and the restarted Controller finds it by its name."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .inferlet.actor import inferlet_actor

    return inferlet_actor().options(name=f"{INFERLET_PREFIX}{uuid.uuid4().hex}", lifetime="detached",
                                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()


def connect(cluster: ClusterConfig | None = None) -> Any:
    """The cluster's Controller actor, started (detached, on the head node, restarted by Ray when
    it dies) with the settings `cluster` if none runs. Call after ray.init()."""
    import ray
    head = {"node:__internal_head__": 0.001}
    return ray.remote(num_cpus=0, max_restarts=-1, resources=head)(Controller).options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote(cluster)


def ask(controller: Any, method: str, *args: Any) -> Any:
    """`controller.<method>(*args)`'s result, asked again while Ray restarts the Controller (for
    up to CONTROLLER_WAIT_S, then its ActorUnavailableError)."""
    import ray

    deadline = time.monotonic() + CONTROLLER_WAIT_S
    while True:
        try:
            return ray.get(getattr(controller, method).remote(*args))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
