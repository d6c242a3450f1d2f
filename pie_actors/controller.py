"""The Controller: a named, detached Ray actor that knows the engines, keeps a warm pool of
inferlet actors (a launch costs a Ray call instead of a new actor, ~0.45 s here) and names the
running inferlets (processes): a process's `session.send_to` looks its peer's actor up here once
(`lookup`, owner-scoped) and then calls that actor itself.

`Runtime.connect()` (runtime.py) is its client: it asks for an engine (`engine`), then for each
launch a process name and a warm actor (`launch`), and streams the run from the actor directly
(forward passes never touch the Controller). The actor reports back with `finished` when the run
ends, however it ends, and the runtime with `lost` when the actor died. It is a plain class
underneath; `connect()` finds the running one or starts it.

A model's engines are its replicas (replicas.py): each launch gets the address of the one its
actor should use. Engines and inferlet actors are named and detached, so when Ray restarts a dead
Controller, the new one finds them again (engines by name, processes by asking each inferlet
actor what it runs) and running programs never notice.
"""
from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from .config import EngineConfig
from .placement import FirstPassChoice
from .replicas import ENGINE_WAIT_S, EngineGone, Replicas, ask_named
from .gpu.engine.wire import EngineAddress
from .inferlet.peers import Endings

NAME, NAMESPACE = "pie_controller", "pie"
INFERLET_PREFIX = "pie_inferlet:"        # inferlet actor names: pie_inferlet:<uuid>
CONTROLLER_WAIT_S = 120.0                # the longest a call waits while Ray restarts the Controller
ProcessKey = tuple[str | None, str]      # (owner, name): names are per owner


class UnknownProcess(KeyError):
    """No running inferlet has that name."""

    def __str__(self) -> str:
        return str(self.args[0])


class EngineMismatch(ValueError):
    """An engine for the model runs already, with other settings."""


class Controller:
    def __init__(self, pool_size: int = 2):
        self.pool_size = pool_size
        self.engines: dict[str, Replicas] = Replicas.find()     # model -> its engines (a restart finds them)
        self.idle: list[Any] = []                               # started InferletActors
        self.processes: dict[ProcessKey, dict[str, Any]] = {}   # (owner, name) -> {actor, model, started}
        self.endings = Endings()                                # how the ones that ended lately ended
        self.nodes: dict[Any, str] = {}                         # inferlet actor id -> its node
        self.launches = 0
        self._numbers = itertools.count(1)
        self._find_actors()
        self._refill()

    def _find_actors(self) -> None:
        """After a restart: the inferlet actors still alive, running a process or idle."""
        for _, actor, (node, process, engine, model) in ask_named(INFERLET_PREFIX, "whereabouts"):
            self.nodes[actor._actor_id] = node
            if process is None:
                self.idle.append(actor)
                continue
            if model is None:                 # its engine is chosen: the model is that engine's
                model = next((m for m, r in self.engines.items()
                              if any(tuple(e.address[:2]) == engine for e in r.replicas)), None)
            self.processes[tuple(process)] = {"actor": actor, "model": model, "started": time.time()}

    def _refill(self) -> None:
        while len(self.idle) < self.pool_size:
            self.idle.append(_new_actor(scheduling_strategy="SPREAD"))   # warms up in the background

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

    def acquire(self) -> Any:
        """A warm inferlet actor, for one run; give it back with `release`."""
        self.launches += 1
        if not self.idle:
            self._refill()
        actor = self.idle.pop()
        self._refill()
        return actor

    def release(self, actor: Any) -> None:
        """Back into the pool (an actor gets a fresh Store for every run). `acquire` has already
        started a replacement, so the pool keeps up to twice its size before it retires actors;
        reusing a released actor (handed out first: the pool is a stack) is the cheapest launch.
        The actor retired is the one idle the longest: the one just released may still be
        finishing its run (it reports `finished` from inside the run)."""
        self.idle.append(actor)
        if len(self.idle) > 2 * self.pool_size:
            import ray
            retired = self.idle.pop(0)
            self.nodes.pop(retired._actor_id, None)
            ray.kill(retired)

    # ---- processes ---------------------------------------------------------------------------

    def launch(self, model: str, name: str | None = None, owner: str | None = None,
               node: str | None = None, prefix: list[int] | None = None) -> dict[str, Any]:
        """Start a process of `model` (whose engine `engine` started) for `owner`: {"process": its
        (owner, name), "actor": a warm InferletActor, or with `node` (a node id or IP) a new one on
        that node (the pool is node-agnostic), "engine": the address of the replica it uses (on
        the actor's node, else the one caching most of `prefix`, the first pass's tokens, else the
        least loaded), or, when no replica runs on the actor's node and `prefix` is not given, a
        FirstPassChoice: the process's first pass asks `choose` with its tokens}. The caller runs
        `actor.run.remote(..., <that engine>, process=<that key>, controller=<this actor>)`. An
        engine that died and did not come back is an EngineGone."""
        if name is not None and (owner, name) in self.processes:
            raise ValueError(f"a process named {name!r} is already running")
        if model not in self.engines:
            raise ValueError(f"no engine for {model!r} runs in this cluster (ask for it with `engine`)")
        name = name or f"inferlet-{next(self._numbers)}"
        while (owner, name) in self.processes:           # a user took that name before us
            name = f"inferlet-{next(self._numbers)}"
        actor = self.acquire() if node is None else _actor_on(node)
        replicas = self.engines[model]
        at = self._node_of(actor) if len(replicas.replicas) > 1 else None
        try:
            if at is not None and prefix is None and not replicas.on(at):
                engine: EngineAddress | FirstPassChoice = FirstPassChoice(model, replicas.info())
            else:
                engine = replicas.choose(at, prefix, owner).address
        except EngineGone:
            self.release(actor)
            raise
        self.processes[owner, name] = {"actor": actor, "model": model, "started": time.time()}
        return {"process": (owner, name), "actor": actor, "engine": engine}

    def choose(self, model: str, node: str | None, prefix: list[int] | None, owner: str | None) -> EngineAddress:
        """The address of the replica of `model` for a process of `owner` on `node` whose first
        pass starts with `prefix` (a process launched with a FirstPassChoice asks at that pass)."""
        return self.engines[model].choose(node, prefix, owner).address

    def _node_of(self, actor: Any) -> str | None:
        """The node of an inferlet actor (asked once; None if it died)."""
        import ray

        if actor._actor_id not in self.nodes:
            try:
                self.nodes[actor._actor_id] = ray.get(actor.whereabouts.remote(), timeout=ENGINE_WAIT_S)[0]
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return None
        return self.nodes[actor._actor_id]

    def lost(self, key: ProcessKey) -> None:
        """A process's actor died (its runtime saw the run's stream break): forget the name; the
        actor is not pooled again."""
        import ray

        process = self.processes.pop(key, None)
        if process is not None:
            self.endings.note(key, "was lost: its actor died")
            self.nodes.pop(process["actor"]._actor_id, None)
            ray.kill(process["actor"])
            self._refill()

    def finished(self, key: ProcessKey, how: str | None = None) -> None:
        """A process's run ended (its actor reports it, and `how`: peers.ending): forget the name,
        pool the actor. (The actor's own handle to itself is a weak reference, so the pool keeps the
        launch's handle.)"""
        process = self.processes.pop(key, None)
        if process is not None:
            if how is not None:
                self.endings.note(key, how)
            self.release(process["actor"])

    def lookup(self, owner: str | None, name: str) -> Any:
        """The actor of `owner`'s running process `name` (for a `session.send_to` of that owner's
        process, which then calls it directly): another owner's process is not found."""
        process = self.processes.get((owner, name))
        if process is None:
            raise UnknownProcess(self.endings.not_running((owner, name), [n for o, n in self.processes if o == owner]))
        return process["actor"]

    def engine_config(self, model: str | None, process: ProcessKey) -> EngineConfig:
        """The settings of the engine that runs `model` (None: the model of `process`), for a
        process that spawns a child on it."""
        if model is None:
            model = self.processes[process]["model"]
        running = self.engines.get(model)
        if running is None:
            raise ValueError(f"no engine for {model!r} runs in this cluster (running: "
                             f"{', '.join(sorted(self.engines)) or 'none'})")
        return running.config

    def status(self) -> dict[str, Any]:
        now = time.time()
        return {"engines": {m: [r.first.address.host, r.first.address.port] for m, r in self.engines.items()},   # no secret
                "replicas": {m: r.status() for m, r in self.engines.items()},
                "processes": [{"owner": o, "name": n, "model": p["model"], "running_s": round(now - p["started"], 3)}
                              for (o, n), p in self.processes.items()],
                "idle_actors": len(self.idle), "launches": self.launches}


def _actor_on(node: str) -> Any:
    """A new InferletActor on the live node whose id or IP is `node` (Ray's node affinity)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for n in nodes:
        if node in (n["NodeID"], n["NodeManagerAddress"]):
            strategy = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            return _new_actor(scheduling_strategy=strategy)
    known = ", ".join(f"{n['NodeID']} at {n['NodeManagerAddress']}" for n in nodes)
    raise ValueError(f"no live node {node!r} in this cluster (nodes: {known})")


def _new_actor(**options: Any) -> Any:
    """A new InferletActor, named and detached: it outlives a Controller that dies (its run goes
    on), and the restarted Controller finds it by its name."""
    from .inferlet.actor import inferlet_actor

    return inferlet_actor().options(name=f"{INFERLET_PREFIX}{uuid.uuid4().hex}", lifetime="detached",
                                    **options).remote()


def connect(pool_size: int = 2) -> Any:
    """The cluster's Controller actor, started (detached, on the head node, restarted by Ray when
    it dies) if none runs. Call after ray.init()."""
    import ray
    head = {"node:__internal_head__": 0.001}
    return ray.remote(num_cpus=0, max_restarts=-1, resources=head)(Controller).options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote(pool_size)


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
