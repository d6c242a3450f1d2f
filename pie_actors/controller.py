"""The Controller: a named, detached Ray actor that knows the engines and keeps a warm pool of
inferlet actors, so a launch costs a Ray call instead of a new actor (~0.45 s here).

Clients ask it for an engine address and a warm actor, stream the run from the actor directly
(forward passes never touch the Controller), and hand the actor back. It is a plain class
underneath; `connect()` finds the running one or starts it.
"""
from __future__ import annotations

from typing import Any

NAME, NAMESPACE = "pie_controller", "pie"


class Controller:
    def __init__(self, pool_size: int = 2):
        self.pool_size = pool_size
        self.engines: dict[str, tuple[Any, tuple[str, int]]] = {}   # model -> (EngineActor, address)
        self.idle: list[Any] = []                                   # started InferletActors
        self.launches = 0
        self._refill()

    def _refill(self) -> None:
        from .inferlet.actor import inferlet_actor
        cls = inferlet_actor()
        while len(self.idle) < self.pool_size:
            self.idle.append(cls.remote())      # not awaited: the pool warms up in the background

    def engine(self, model: str = "", **engine_kwargs: Any) -> tuple[str, int]:
        """The address of `model`'s engine, started in the cluster on first use."""
        from .config import load_config
        from .gpu.server import start_engine_actor
        model = model or load_config()["model"]
        if model not in self.engines:
            self.engines[model] = start_engine_actor(model, **engine_kwargs)
        return self.engines[model][1]

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
        reusing a released actor (handed out first: the pool is a stack) is the cheapest launch."""
        if len(self.idle) < 2 * self.pool_size:
            self.idle.append(actor)
        else:
            import ray
            ray.kill(actor)

    def status(self) -> dict[str, Any]:
        return {"engines": {m: list(addr) for m, (_, addr) in self.engines.items()},
                "idle_actors": len(self.idle), "launches": self.launches}


def connect(pool_size: int = 2) -> Any:
    """The cluster's Controller actor, started (detached) if none runs. Call after ray.init()."""
    import ray
    return ray.remote(num_cpus=0)(Controller).options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote(pool_size)


def run_on_cluster(source: str, input: Any, model: str = "", *, on_send=None, timeout: float = 300.0,
                   **engine_kwargs: Any) -> Any:
    """Run one inferlet in a warm actor of the connected cluster; stream its sends to `on_send`.
    Returns its output, or raises InferletError."""
    import ray

    from .inferlet.host import InferletError
    controller = connect()
    address = ray.get(controller.engine.remote(model, **engine_kwargs))
    actor = ray.get(controller.acquire.remote())
    try:
        for ref in actor.run.remote(source, input, address, timeout):
            event = ray.get(ref)
            if "send" in event:
                if on_send:
                    on_send(event["send"])
            elif "error" in event:
                e = event["error"]
                raise InferletError(e["kind"], e["message"], e["traceback"])
            else:
                return event["result"]
    finally:
        controller.release.remote(actor)
