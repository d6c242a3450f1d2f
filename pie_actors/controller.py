"""The Controller: a named, detached Ray actor that knows the engines, keeps a warm pool of
inferlet actors (a launch costs a Ray call instead of a new actor, ~0.45 s here) and names the
running inferlets (processes), so clients and other inferlets can message or stop them.

A client asks it to `launch` (an engine address, a warm actor, a process name), streams the run
from the actor directly (forward passes never touch the Controller), and the actor reports back
with `finished` when the run ends, however it ends. It is a plain class underneath; `connect()`
finds the running one or starts it.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

NAME, NAMESPACE = "pie_controller", "pie"


class UnknownProcess(KeyError):
    """No running inferlet has that name."""

    def __str__(self) -> str:
        return str(self.args[0])


class Controller:
    def __init__(self, pool_size: int = 2):
        self.pool_size = pool_size
        self.engines: dict[str, tuple[Any, tuple[str, int]]] = {}   # model -> (EngineActor, address)
        self.idle: list[Any] = []                                   # started InferletActors
        self.processes: dict[str, dict[str, Any]] = {}              # name -> {actor, model, started}
        self.launches = 0
        self._numbers = itertools.count(1)
        self._refill()

    def _refill(self) -> None:
        from .inferlet.actor import inferlet_actor
        cls = inferlet_actor()
        while len(self.idle) < self.pool_size:
            self.idle.append(cls.remote())      # not awaited: the pool warms up in the background

    def engine(self, model: str = "", **engine_kwargs: Any) -> tuple[str, int]:
        """The address of `model`'s engine, started in the cluster on first use."""
        from .config import load_config
        from .gpu.engine.actor import start_engine_actor
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
        reusing a released actor (handed out first: the pool is a stack) is the cheapest launch.
        The actor retired is the one idle the longest: the one just released may still be
        finishing its run (it reports `finished` from inside the run)."""
        self.idle.append(actor)
        if len(self.idle) > 2 * self.pool_size:
            import ray
            ray.kill(self.idle.pop(0))

    # ---- processes ---------------------------------------------------------------------------

    def launch(self, model: str = "", name: str | None = None, **engine_kwargs: Any) -> dict[str, Any]:
        """Start a process: {"process": its name, "actor": a warm InferletActor, "engine": address}.
        The caller runs `actor.run.remote(..., process=name, controller=<this actor>)`."""
        if name is not None and name in self.processes:
            raise ValueError(f"a process named {name!r} is already running")
        address = self.engine(model, **engine_kwargs)
        name = name or f"inferlet-{next(self._numbers)}"
        while name in self.processes:                    # a user took that name before us
            name = f"inferlet-{next(self._numbers)}"
        actor = self.acquire()
        self.processes[name] = {"actor": actor, "model": model, "started": time.time()}
        return {"process": name, "actor": actor, "engine": address}

    def finished(self, name: str) -> None:
        """A process's run ended (its actor reports it): forget the name, pool the actor. (The
        actor's own handle to itself is a weak reference, so the pool keeps the launch's handle.)"""
        process = self.processes.pop(name, None)
        if process is not None:
            self.release(process["actor"])

    def _process(self, name: str) -> dict[str, Any]:
        if name not in self.processes:
            running = ", ".join(sorted(self.processes)) or "none"
            raise UnknownProcess(f"no running inferlet named {name!r} (running: {running})")
        return self.processes[name]

    def send(self, name: str, message: Any, sender: str | None = None) -> None:
        """Deliver `message` to process `name`'s `session.receive` (from a client, or from the
        process `sender`'s `session.send_to`)."""
        self._process(name)["actor"].deliver.remote(message, name)

    def kill(self, name: str) -> None:
        """Cancel process `name`: it ends at its next host call, its KV pages return."""
        self._process(name)["actor"].cancel.remote(f"killed by request (process {name!r})")

    def status(self) -> dict[str, Any]:
        now = time.time()
        return {"engines": {m: list(addr) for m, (_, addr) in self.engines.items()},
                "processes": {n: {"model": p["model"], "running_s": round(now - p["started"], 3)}
                              for n, p in self.processes.items()},
                "idle_actors": len(self.idle), "launches": self.launches}


def connect(pool_size: int = 2) -> Any:
    """The cluster's Controller actor, started (detached) if none runs. Call after ray.init()."""
    import ray
    return ray.remote(num_cpus=0)(Controller).options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote(pool_size)


def run_on_cluster(source: str, input: Any, model: str = "", *, name: str | None = None, on_send=None,
                   on_send_file=None, on_start=None, timeout: float = 300.0,
                   files: dict[str, bytes] | None = None, bundle: dict[str, str] | None = None,
                   **engine_kwargs: Any) -> Any:
    """Run one inferlet as a named process in a warm actor of the connected cluster; stream its
    sends to `on_send` (text) and `on_send_file` (bytes). `on_start(process_name)` is called once
    it is launched. Interrupting the caller (Ctrl-C) kills the process. Returns its output, or
    raises InferletError."""
    import ray

    from .inferlet.host import InferletError
    controller = connect()
    launched = ray.get(controller.launch.remote(model, name, **engine_kwargs))
    process = launched["process"]
    if on_start is not None:
        on_start(process)
    stream = launched["actor"].run.remote(source, input, launched["engine"], timeout, files=files,
                                          bundle=bundle, process=process, controller=controller)
    try:
        for ref in stream:
            event = ray.get(ref)
            if "send" in event:
                if on_send:
                    on_send(event["send"])
            elif "file" in event:
                if on_send_file:
                    on_send_file(event["file"])
            elif "error" in event:
                e = event["error"]
                raise InferletError(e["kind"], e["message"], e["traceback"])
            else:
                return event["result"]
        raise InferletError("trap", f"process {process!r} ended without a result")
    except KeyboardInterrupt:
        controller.kill.remote(process)
        raise
