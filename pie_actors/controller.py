"""The Controller: a named, detached Ray actor that knows the engines, keeps a warm pool of
inferlet actors (a launch costs a Ray call instead of a new actor, ~0.45 s here) and names the
running inferlets (processes): a process's `session.send_to` looks its peer's actor up here once
(`lookup`, owner-scoped) and then calls that actor itself.

`Runtime.connect()` (runtime.py) is its client: it asks for an engine (`engine`), then for each
launch a process name and a warm actor (`launch`), and streams the run from the actor directly
(forward passes never touch the Controller). The actor reports back with `finished` when the run
ends, however it ends. It is a plain class underneath; `connect()` finds the running one or
starts it.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from .config import EngineConfig
from .gpu.engine.wire import EngineAddress

NAME, NAMESPACE = "pie_controller", "pie"
ProcessKey = tuple[str | None, str]      # (owner, name): names are per owner


class UnknownProcess(KeyError):
    """No running inferlet has that name."""

    def __str__(self) -> str:
        return str(self.args[0])


class EngineMismatch(ValueError):
    """An engine for the model runs already, with other settings."""


@dataclass
class _Engine:
    config: EngineConfig
    actor: Any
    address: EngineAddress            # with the engine's secret, handed to the runtime's actors only


class Controller:
    def __init__(self, pool_size: int = 2):
        self.pool_size = pool_size
        self.engines: dict[str, _Engine] = {}                   # model -> its engine
        self.idle: list[Any] = []                               # started InferletActors
        self.processes: dict[ProcessKey, dict[str, Any]] = {}   # (owner, name) -> {actor, model, started}
        self.launches = 0
        self._numbers = itertools.count(1)
        self._refill()

    def _refill(self) -> None:
        from .inferlet.actor import inferlet_actor
        cls = inferlet_actor()
        while len(self.idle) < self.pool_size:
            self.idle.append(cls.remote())      # not awaited: the pool warms up in the background

    def engine(self, config: EngineConfig, long_lived: bool = True) -> tuple[Any, EngineAddress]:
        """The engine of `config.model` (its actor, and its data-plane address with the secret),
        started in the cluster on first use (`long_lived`: see `Engine.from_config`). Asking with
        other settings than the running engine's is an EngineMismatch: one engine per model, never
        reused silently for settings it does not have."""
        running = self.engines.get(config.model)
        if running is None:
            from .gpu.engine.actor import start_engine_actor
            actor, address = start_engine_actor(config, long_lived=long_lived)
            running = self.engines[config.model] = _Engine(config, actor, address)
        elif running.config != config:
            raise EngineMismatch(
                f"the cluster's engine for {config.model!r} runs with other settings: "
                f"{'; '.join(running.config.differences(config))}. Ask with its settings, or restart "
                "the cluster to change them")
        return running.actor, running.address

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
            ray.kill(self.idle.pop(0))

    # ---- processes ---------------------------------------------------------------------------

    def launch(self, model: str, name: str | None = None, owner: str | None = None,
               node: str | None = None) -> dict[str, Any]:
        """Start a process of `model` (whose engine `engine` started) for `owner`: {"process": its
        (owner, name), "actor": a warm InferletActor, or with `node` (a node id or IP) a new one on
        that node (the pool is node-agnostic)}. The caller runs `actor.run.remote(...,
        process=<that key>, controller=<this actor>)`."""
        if name is not None and (owner, name) in self.processes:
            raise ValueError(f"a process named {name!r} is already running")
        if model not in self.engines:
            raise ValueError(f"no engine for {model!r} runs in this cluster (ask for it with `engine`)")
        name = name or f"inferlet-{next(self._numbers)}"
        while (owner, name) in self.processes:           # a user took that name before us
            name = f"inferlet-{next(self._numbers)}"
        actor = self.acquire() if node is None else _actor_on(node)
        self.processes[owner, name] = {"actor": actor, "model": model, "started": time.time()}
        return {"process": (owner, name), "actor": actor}

    def finished(self, key: ProcessKey) -> None:
        """A process's run ended (its actor reports it): forget the name, pool the actor. (The
        actor's own handle to itself is a weak reference, so the pool keeps the launch's handle.)"""
        process = self.processes.pop(key, None)
        if process is not None:
            self.release(process["actor"])

    def lookup(self, owner: str | None, name: str) -> Any:
        """The actor of `owner`'s running process `name` (for a `session.send_to` of that owner's
        process, which then calls it directly): another owner's process is not found."""
        process = self.processes.get((owner, name))
        if process is None:
            running = ", ".join(sorted(n for o, n in self.processes if o == owner)) or "none"
            raise UnknownProcess(f"no running inferlet named {name!r} (running: {running})")
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
        return {"engines": {m: [e.address.host, e.address.port] for m, e in self.engines.items()},   # no secret
                "processes": [{"owner": o, "name": n, "model": p["model"], "running_s": round(now - p["started"], 3)}
                              for (o, n), p in self.processes.items()],
                "idle_actors": len(self.idle), "launches": self.launches}


def _actor_on(node: str) -> Any:
    """A new InferletActor on the live node whose id or IP is `node` (Ray's node affinity)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .inferlet.actor import inferlet_actor

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for n in nodes:
        if node in (n["NodeID"], n["NodeManagerAddress"]):
            strategy = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            return inferlet_actor().options(scheduling_strategy=strategy).remote()
    known = ", ".join(f"{n['NodeID']} at {n['NodeManagerAddress']}" for n in nodes)
    raise ValueError(f"no live node {node!r} in this cluster (nodes: {known})")


def connect(pool_size: int = 2) -> Any:
    """The cluster's Controller actor, started (detached) if none runs. Call after ray.init()."""
    import ray
    return ray.remote(num_cpus=0)(Controller).options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote(pool_size)
