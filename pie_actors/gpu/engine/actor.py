"""The engine in a Ray actor: `EngineActor` wraps `EngineServer` (data_plane.py) and nothing more.

Ray calls only start it and ask for its address, stats and saved working sets; passes go over the data plane's socket.
"""
from __future__ import annotations

from typing import Any

from ...config import EngineConfig
from . import wire
from .data_plane import serve_model


class EngineActor:
    """An engine and its server inside a Ray actor (see `start_engine_actor`). `host` is the
    interface to listen on; "0.0.0.0" advertises the node's IP address. `long_lived`: see
    `Engine.from_config`."""

    def __init__(self, config: EngineConfig, host: str = "0.0.0.0", port: int = 0, long_lived: bool = True):
        self.config = config
        self.server, (self.host, self.port) = serve_model(config, host, port, long_lived=long_lived)
        self.engine = self.server.engine
        if self.host in ("0.0.0.0", "::", ""):
            import ray
            self.host = ray.util.get_node_ip_address()

    def address(self) -> tuple[str, int]:
        return self.host, self.port

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
                       host: str = "0.0.0.0", port: int = 0, long_lived: bool = True) -> tuple[Any, tuple[str, int]]:
    """Start an `EngineActor` (named `name` when given; outliving its driver when `detached`) and
    wait until it serves. Returns (actor handle, (host, port))."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "name": name}
    if detached:
        options["lifetime"] = "detached"
    actor = ray.remote(EngineActor).options(**options).remote(config, host, port, long_lived)
    return actor, tuple(ray.get(actor.address.remote()))
