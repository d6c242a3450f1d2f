"""The engine in a Ray actor: `EngineActor` wraps `EngineServer` (data_plane.py) and nothing more.

Ray calls only start it and ask for its address and stats; passes go over the data plane's socket.
"""
from __future__ import annotations

import os
from typing import Any

from . import wire
from .data_plane import serve_model


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class EngineActor:
    """An engine and its server inside a Ray actor; decorate at use: `ray.remote(num_cpus=0)(EngineActor)`.

    Ray calls only start it and ask for its address and stats; passes go over the socket.
    `host` is the interface to listen on; "0.0.0.0" advertises the node's IP address.
    """

    def __init__(self, model: str = "", host: str = "0.0.0.0", port: int = 0, **engine_kwargs: Any):
        # Ray sets OMP_NUM_THREADS=1 in actors; the engine should use the node's cores.
        engine_kwargs.setdefault("num_threads", _cores())
        self.server, (self.host, self.port) = serve_model(model, host, port, **engine_kwargs)
        self.engine = self.server.engine
        if self.host in ("0.0.0.0", "::", ""):
            import ray
            self.host = ray.util.get_node_ip_address()

    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def stats(self) -> wire.Stats:
        return self.server.stats()

    def close(self) -> None:
        self.server.close()
        self.engine.close()


def start_engine_actor(model: str = "", *, name: str | None = None, detached: bool = False,
                       host: str = "0.0.0.0", port: int = 0, **engine_kwargs: Any) -> tuple[Any, tuple[str, int]]:
    """Start an `EngineActor` (named `name` when given; outliving its driver when `detached`) and
    wait until it serves. Returns (actor handle, (host, port))."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "name": name}
    if detached:
        options["lifetime"] = "detached"
    actor = ray.remote(EngineActor).options(**options).remote(model, host, port, **engine_kwargs)
    return actor, tuple(ray.get(actor.address.remote()))
