"""Where engines run and which engine a process uses.

`engine_resources` says what Ray resources an engine's ranks ask for: a GPU per rank on CUDA, and
all tensor-parallel ranks, rank 0 (the engine actor) included, in one STRICT_PACK placement group
(one bundle per rank, bundle i for rank i), so NCCL's ranks share a node. A CPU engine of one rank
asks for nothing (num_cpus=0: a 2-core node would otherwise fit two actors in all).

`choose_replica` picks the replica of a model a new process connects to: the one on the process's
own node, else the one whose prefix cache holds the longest prefix of its first pass's tokens,
else the least loaded (fewest live sequences). A process with no replica on its node is launched
with a `FirstPassChoice` in place of an address: its first pass makes the choice, by its tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .config import EngineConfig

CPU_RANK = {"CPU": 0.01}    # a placement-group bundle may not be empty; a CPU rank asks for almost nothing


@dataclass(frozen=True)
class EngineResources:
    """The Ray options of an engine's ranks. `bundles` is empty when the engine needs no placement
    group (one CPU rank)."""

    rank_options: dict[str, float]            # num_cpus / num_gpus of each rank's actor
    bundles: list[dict[str, float]] = field(default_factory=list)
    strategy: str = "STRICT_PACK"


def uses_gpus(config: EngineConfig, cluster_gpus: float) -> bool:
    """Whether `config`'s engine runs on CUDA: "cuda..." does, "cpu" does not, "auto" does when
    the cluster has GPUs (the engine actor sees a GPU only if it asks Ray for one)."""
    if config.device == "auto":
        return cluster_gpus > 0
    return config.device.startswith("cuda")


def engine_resources(config: EngineConfig, gpus: bool) -> EngineResources:
    """The resources of `config`'s engine; `gpus`: it runs on CUDA (see `uses_gpus`)."""
    if gpus:
        return EngineResources({"num_cpus": 0, "num_gpus": 1}, [{"GPU": 1}] * config.tp)
    if config.tp == 1:
        return EngineResources({"num_cpus": 0, "num_gpus": 0})
    return EngineResources({"num_cpus": CPU_RANK["CPU"], "num_gpus": 0}, [dict(CPU_RANK)] * config.tp)


def replica_nodes(nodes: list[dict[str, Any]], resources: EngineResources, replicas: int) -> list[str | None]:
    """The node id of each of `replicas` replicas: the alive nodes (`ray.nodes()` entries) that
    hold a replica's resources, taken in turn, so replicas spread one per node while there are
    nodes. None (Ray places it) when no node qualifies or there is only one replica."""
    if replicas == 1:
        return [None]
    need = {"GPU": sum(b.get("GPU", 0) for b in resources.bundles)}
    fit = sorted(n["NodeID"] for n in nodes if n.get("Alive")
                 and all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items()))
    return [fit[i % len(fit)] if fit else None for i in range(replicas)]


@dataclass(frozen=True)
class FirstPassChoice:
    """What a process is launched with in place of its engine's address when its replica is chosen
    at its first pass (`Controller.choose`): the model, and its engines' `info` (wire.Info)."""

    model: str
    info: dict[str, Any]


@dataclass
class ReplicaView:
    """What `choose_replica` knows of one replica: its node, how many of the first pass's tokens
    its prefix cache holds, and its live sequences."""

    node: str | None
    cached_tokens: int = 0
    sequences: int = 0


def choose_replica(replicas: Sequence[ReplicaView], node: str | None) -> tuple[int, str]:
    """(index, reason) of the replica a process on `node` connects to. Reason "local": a replica
    runs on `node` (among several there, the one the next rules pick); else "prefix": the one
    caching the most of the first pass; else "least_loaded". Ties go to the lower index."""
    if not replicas:
        raise ValueError("no replica to choose from")
    local = [i for i, r in enumerate(replicas) if node is not None and r.node == node]
    candidates = local or list(range(len(replicas)))
    best = max(candidates, key=lambda i: (replicas[i].cached_tokens, -i))
    if replicas[best].cached_tokens == 0:
        best = min(candidates, key=lambda i: (replicas[i].sequences, i))
        reason = "least_loaded"
    else:
        reason = "prefix"
    return best, "local" if local else reason
