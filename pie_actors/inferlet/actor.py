"""InferletActor: a Ray actor that runs inferlets in its WebAssembly sandbox, one at a time.

The actor deserializes the compiled runner once when it starts; each run gets a fresh Store. Its
`run` method is a Ray streaming generator: it yields each `session.send` message as the inferlet
produces it and ends with the result, so a client reads the stream with
`for ref in actor.run.remote(...): ray.get(ref)`. Forward passes go straight from the actor to the
engine over its socket (inferlet/runtime.py), never through Ray. torch is never imported here.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from .host import InferletError
from .runtime import default_sandbox, run_inferlet

_DONE = object()


class InferletActor:
    """Plain class; the Ray actor is `ray.remote(num_cpus=0)(InferletActor)` (see `inferlet_actor`)."""

    def __init__(self) -> None:
        self.sandbox = default_sandbox()

    def ready(self) -> bool:
        """For warm pools: returns once the sandbox is loaded."""
        return True

    def run(self, source: str, input: Any, engine_address: tuple[str, int],
            timeout: float = 300.0) -> Iterator[dict]:
        """Yields {"send": text} items while the inferlet runs, then {"result": output}, or
        {"error": {"kind", "message", "traceback"}} when it fails (the actor stays usable)."""
        events: queue.Queue = queue.Queue()

        def work() -> None:
            try:
                output = run_inferlet(source, input, tuple(engine_address), timeout=timeout,
                                      sandbox=self.sandbox, on_send=lambda text: events.put({"send": text}))
                events.put({"result": output})
            except InferletError as e:
                events.put({"error": {"kind": e.kind, "message": e.message, "traceback": e.guest_traceback}})
            finally:
                events.put(_DONE)

        threading.Thread(target=work, name="inferlet", daemon=True).start()
        while (event := events.get()) is not _DONE:
            yield event


def inferlet_actor(**options: Any):
    """The Ray actor class. num_cpus=0: an inferlet mostly waits on the engine, and whole-CPU actors
    would cap a 2-core node at two inferlets."""
    import ray
    return ray.remote(num_cpus=0, **options)(InferletActor)
