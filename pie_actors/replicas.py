"""The engine replicas of one model, as the Controller keeps them.

`Replicas.start` starts `config.replicas` engine actors, one per node while there are nodes that
hold one (placement.replica_nodes). Each is a named, detached actor that Ray restarts (on a new
port) when it dies, so a restarted Controller finds its engines again (`Replicas.find`) and running
programs never depend on the Controller staying up. `choose` picks the replica a new process
connects to (placement.choose_replica) and counts each choice by its reason.
"""
from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

from .config import EngineConfig
from .placement import ReplicaView, choose_replica, engine_resources, replica_nodes, uses_gpus

ENGINE_PREFIX = "pie_engine:"     # engine actor names: pie_engine:<replica>:<model>
ENGINE_RESTARTS = 3               # times Ray restarts a dead engine actor
ENGINE_WAIT_S = 300.0             # the longest a launch waits for an engine (a restart loads the model)
VIEW_WAIT_S = 2.0                 # the longest a launch waits for the replicas' load and cache figures


class EngineGone(RuntimeError):
    """A model's engine died and did not come back (in time)."""


@dataclass
class Replica:
    actor: Any
    address: Any                  # what EngineActor.address returns
    node: str                     # the Ray node it runs on
    chosen: Counter[str] = field(default_factory=Counter)   # processes it was chosen for, by reason


@dataclass(frozen=True)
class ReplicaStatus:
    address: tuple[str, int]
    node: str
    chosen: dict[str, int]                      # processes it was chosen for, by reason


class Replicas:
    """One model's engines, replica 0 first."""

    def __init__(self, config: EngineConfig, replicas: list[Replica]) -> None:
        self.config, self.replicas = config, replicas
        self._info: dict[str, Any] | None = None

    @classmethod
    def start(cls, config: EngineConfig, long_lived: bool = True) -> Replicas:
        """Start `config.replicas` engines, all at once (each loads the model), and wait until
        each serves."""
        import ray

        from .gpu.engine.actor import start_engine_actor

        def start(i: int, node: str | None) -> Replica:
            actor, address = start_engine_actor(config, name=f"{ENGINE_PREFIX}{i}:{config.model}", detached=True,
                                                node=node, long_lived=long_lived, max_restarts=ENGINE_RESTARTS)
            return Replica(actor, address, ray.get(actor.node.remote()))

        resources = engine_resources(config, uses_gpus(config, ray.cluster_resources().get("GPU", 0)))
        nodes = replica_nodes(ray.nodes(), resources, config.replicas)
        with ThreadPoolExecutor(len(nodes)) as pool:
            return cls(config, list(pool.map(start, range(len(nodes)), nodes)))

    @classmethod
    def find(cls) -> dict[str, Replicas]:
        """The engines running in this namespace, by model (a restarted Controller's view)."""
        found: dict[str, list[tuple[int, EngineConfig, Replica]]] = {}
        for name, actor, (config, address, node) in ask_named(ENGINE_PREFIX, "describe"):
            index = int(name[len(ENGINE_PREFIX):].split(":", 1)[0])
            found.setdefault(config.model, []).append((index, config, Replica(actor, address, node)))
        return {model: cls(entries[0][1], [r for _, _, r in sorted(entries, key=lambda e: e[0])])
                for model, entries in found.items()}

    @property
    def first(self) -> Replica:
        return self.replicas[0]

    def on(self, node: str | None) -> bool:
        """Whether a replica runs on `node`."""
        return any(r.node == node for r in self.replicas)

    def info(self) -> dict[str, Any]:
        """The model's engine `info` (wire.Info: the same on every replica), asked once."""
        import ray

        if self._info is None:
            self._info = ray.get(self.first.actor.info.remote(), timeout=ENGINE_WAIT_S)
        return self._info

    def choose(self, node: str | None, prefix: list[int] | None = None, owner: str | None = None) -> Replica:
        """The replica for a new process of `owner` on `node` whose first pass starts with `prefix`
        (when known), its address and node refreshed: a restarted engine serves on a new port,
        maybe on another node."""
        if len(self.replicas) == 1:
            replica, reason = self.first, "only"
        else:
            replica, reason = self._pick(node, prefix, owner)
        replica.chosen[reason] += 1
        _, replica.address, replica.node = self._describe(replica)
        return replica

    def _pick(self, node: str | None, prefix: list[int] | None, owner: str | None) -> tuple[Replica, str]:
        replicas = self.replicas
        if self.on(node):
            index, reason = choose_replica([ReplicaView(r.node) for r in replicas], node)
            return replicas[index], reason
        # only the replicas that answer now: one restarting, or on a lost node, is passed over
        loads = self._quick([r.actor.stats.remote() for r in replicas])
        cached = (self._quick([r.actor.cached_prefix.remote(prefix, owner) for r in replicas]) if prefix
                  else [0] * len(replicas))
        alive = [i for i, s in enumerate(loads) if s is not None] or list(range(len(replicas)))
        views = [ReplicaView(replicas[i].node, cached[i] or 0, loads[i]["sequences"] if loads[i] else 0)
                 for i in alive]
        index, reason = choose_replica(views, node)
        return replicas[alive[index]], reason

    @staticmethod
    def _quick(refs: list[Any]) -> list[Any]:
        """The answers that come within VIEW_WAIT_S; None for the others."""
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=VIEW_WAIT_S)
        answers = []
        for ref in refs:
            try:
                answers.append(ray.get(ref) if ref in ready else None)
            except ray.exceptions.RayError:
                answers.append(None)
        return answers

    def _describe(self, replica: Replica) -> tuple[EngineConfig, Any, str]:
        """`describe` of `replica`, waiting out a restart (up to ENGINE_WAIT_S)."""
        import ray

        deadline = time.monotonic() + ENGINE_WAIT_S
        while True:
            try:
                return ray.get(replica.actor.describe.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.ActorUnavailableError:      # restarting: ask again once it is back
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            except ray.exceptions.RayActorError as e:
                raise EngineGone(f"an engine of {self.config.model!r} died and was not restarted: {e}") from None
            except ray.exceptions.GetTimeoutError:
                break
        raise EngineGone(f"an engine of {self.config.model!r} did not come back within {ENGINE_WAIT_S:.0f} s")

    def status(self) -> list[ReplicaStatus]:
        return [ReplicaStatus((r.address[0], r.address[1]), r.node, dict(r.chosen)) for r in self.replicas]


def ask_named(prefix: str, method: str) -> Iterator[tuple[str, Any, Any]]:
    """(name, actor, `method`'s answer) of each live named actor of this namespace whose name
    starts with `prefix`; one that died for good is left out."""
    import ray

    for name in ray.util.list_named_actors():
        if name.startswith(prefix):
            actor = ray.get_actor(name)
            try:
                yield name, actor, ray.get(getattr(actor, method).remote(), timeout=ENGINE_WAIT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
