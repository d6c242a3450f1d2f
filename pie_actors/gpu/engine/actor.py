"""The engine in a Ray actor: `EngineActor` wraps `EngineServer` (data_plane.py) and nothing more.

Ray calls only start it and ask for its address, stats, placement and saved working sets; passes go
over the data plane's socket. `start_engine_actor` asks Ray for what the engine uses (placement.py):
a GPU per rank on CUDA, all tensor-parallel ranks in one placement group (bundle 0 is this actor's).
"""
from __future__ import annotations

from typing import Any

from ...config import EngineConfig
from ...kvstore import partition_root
from . import wire
from .data_plane import serve_model


class EngineActor:
    """An engine and its server inside a Ray actor (see `start_engine_actor`). `host` is the
    interface to listen on; "0.0.0.0" advertises the node's IP address. `long_lived`: see
    `Engine.from_config`."""

    def __init__(self, config: EngineConfig, host: str = "0.0.0.0", port: int = 0, long_lived: bool = True):
        self.config = config
        self.server, (self.host, self.port, _) = serve_model(config, host, port, long_lived=long_lived,
                                                              own_process=True)
        self.engine = self.server.engine
        if self.host in ("0.0.0.0", "::", ""):
            import ray
            self.host = ray.util.get_node_ip_address()

    def address(self) -> wire.EngineAddress:
        """Where the data plane listens, with the secret its connections prove: for the runtime's
        own actors only."""
        return wire.EngineAddress(self.host, self.port, self.server.secret)

    def node(self) -> str:
        """The Ray node this engine runs on."""
        import ray
        return ray.get_runtime_context().get_node_id()

    def describe(self) -> tuple[EngineConfig, Any, str]:
        """(config, address, node): what a restarted Controller needs to know of this engine."""
        return self.config, self.address(), self.node()

    def placement(self) -> dict[str, Any]:
        """The placement group of rank 0 and of each further rank (None: none), by id."""
        import ray
        pg = ray.util.get_current_placement_group()
        remote = self.engine._remote
        ranks = ray.get([a.placement_group.remote() for a in remote[1]]) if remote else []
        return {"rank0": pg.id.hex() if pg else None, "ranks": ranks}

    def cached_prefix(self, tokens: list[int], owner: str | None = None) -> int:
        """How many leading tokens of `tokens` this engine's prefix cache holds for `owner`'s
        processes (a routing hint: the pages may be evicted before a pass uses them)."""
        return self.engine.kv.cached_prefix(tokens, partition_root(self.server.secret, owner))

    def info(self) -> wire.Info:
        return self.server.info

    def stats(self) -> wire.Stats:
        return self.server.stats()

    def saved(self, owner: str | None) -> list[wire.SavedSet]:
        return self.engine.list_saved(owner)

    def delete_saved(self, name: str, owner: str | None) -> None:
        self.engine.delete_saved(name, owner)

    def close(self) -> None:
        self.server.close()
        self.engine.close()


def start_engine_actor(config: EngineConfig, *, name: str | None = None, detached: bool = False,
                       host: str = "0.0.0.0", port: int = 0, long_lived: bool = True,
                       node: str | None = None, max_restarts: int = 0) -> tuple[Any, tuple[str, int]]:
    """Start an `EngineActor` (named `name` when given; outliving its driver, placement group
    included, when `detached`; on Ray node `node` when given; restarted by Ray up to
    `max_restarts` times, on a new port) and wait until it serves. Returns (actor handle, (host, port))."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    from ...placement import engine_resources, uses_gpus

    resources = engine_resources(config, uses_gpus(config, ray.cluster_resources().get("GPU", 0)))
    options: dict[str, Any] = {**resources.rank_options, "name": name, "max_restarts": max_restarts}
    if detached:
        options["lifetime"] = "detached"
    if resources.bundles:
        pg = ray.util.placement_group(resources.bundles, strategy=resources.strategy,
                                      lifetime="detached" if detached else None, _soft_target_node_id=node)
        ray.get(pg.ready(), timeout=60)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    elif node is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    actor = ray.remote(EngineActor).options(**options).remote(config, host, port, long_lived)
    return actor, ray.get(actor.address.remote())
