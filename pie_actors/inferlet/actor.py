"""InferletActor: a Ray actor that runs inferlets in its WebAssembly sandbox, one at a time.

The actor deserializes the compiled runner once when it starts; each run gets a fresh Store. Its
`run` method is a Ray streaming generator: it yields each `session.send` message (and each
`session.send_file` blob) as the inferlet produces it and ends with the result, so a client reads
the stream with `for ref in actor.run.remote(...): ray.get(ref)`. Forward passes go straight from
the actor to the engine over its socket (inferlet/runtime.py), never through Ray. torch is never
imported here.

While a run streams, `deliver` (a message for its `session.receive`) and `cancel` are served
concurrently (the actor has a few threads). A run started by the Controller under a process name
hands itself back to the Controller when it ends, however it ends.
"""
from __future__ import annotations

import hashlib
import queue
import threading
from functools import partial
from pathlib import Path
from typing import Any, Iterator

from .build import cache_dir
from .host import HostOpError, InferletError, Sandbox
from .run import InferletHost, default_sandbox, run_inferlet

_DONE = object()
MAX_BUNDLES = 4          # bundle sandboxes kept loaded per actor


def bundle_files(folder: str | Path) -> dict[str, str]:
    """A bundle folder's Python files (relative path -> text), to ship to an actor."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_text(encoding="utf-8") for p in sorted(folder.rglob("*.py"))}


class InferletActor:
    """Plain class; the Ray actor is `inferlet_actor()` (see there)."""

    def __init__(self) -> None:
        self.sandbox = default_sandbox()
        self._bundles: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        self._process: str | None = None   # the process name of the run in progress
        self._current: tuple[Sandbox, InferletHost] | None = None
        self._early: list[Any] = []        # messages that arrived before the run's host existed

    def ready(self) -> bool:
        """For warm pools: returns once the sandbox is loaded."""
        return True

    def _sandbox_for(self, bundle: dict[str, str] | None) -> Sandbox:
        """The shared runner, or the component of a bundle (unpacked under the cache, built once)."""
        if not bundle:
            return self.sandbox
        key = hashlib.blake2b(repr(sorted(bundle.items())).encode(), digest_size=16).hexdigest()
        if key not in self._bundles:
            folder = cache_dir() / "bundles" / key
            for rel, text in bundle.items():
                path = folder / rel
                if folder not in path.resolve().parents:
                    raise ValueError(f"bundle path {rel!r} leaves the bundle")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
            if len(self._bundles) >= MAX_BUNDLES:
                self._bundles.pop(next(iter(self._bundles)))
            self._bundles[key] = Sandbox(bundle=folder)
        return self._bundles[key]

    def run(self, source: str, input: Any, engine_address: tuple[str, int], timeout: float = 300.0, *,
            files: dict[str, bytes] | None = None, bundle: dict[str, str] | None = None,
            process: str | None = None, controller: Any = None) -> Iterator[dict]:
        """Yields {"send": text} and {"file": bytes} items while the inferlet runs, then
        {"result": output}, or {"error": {"kind", "message", "traceback"}} when it fails (the
        actor stays usable). `bundle`: the files of a bundle (see `bundle_files`), whose main.py
        runs instead of `source`. With a `controller`, the run is the named `process`:
        `session.send_to` reaches other processes, and the actor hands itself back at the end."""
        events: queue.Queue = queue.Queue()
        send_to = None if controller is None else partial(_send_to, controller, process)

        def started(host: InferletHost) -> None:
            with self._lock:
                self._current = (sandbox, host)
                for message in self._early:
                    host.deliver(message)
                self._early.clear()

        def work() -> None:
            try:
                output = run_inferlet(source, input, tuple(engine_address), timeout=timeout, sandbox=sandbox,
                                      on_send=lambda text: events.put({"send": text}),
                                      on_send_file=lambda data: events.put({"file": data}),
                                      files=files, send_to=send_to, on_start=started)
                events.put({"result": output})
            except InferletError as e:
                events.put({"error": {"kind": e.kind, "message": e.message, "traceback": e.guest_traceback}})
            finally:
                with self._lock:
                    self._current = None
                    self._early.clear()
                events.put(_DONE)

        with self._lock:
            self._process = process
        try:
            sandbox = self._sandbox_for(bundle)
            threading.Thread(target=work, name="inferlet", daemon=True).start()
            while (event := events.get()) is not _DONE:
                yield event
        except Exception as e:            # a bundle that does not build, say
            yield {"error": {"kind": "trap", "message": f"{type(e).__name__}: {e}", "traceback": ""}}
        finally:
            with self._lock:
                self._process = None
            if controller is not None:
                controller.finished.remote(process)

    def deliver(self, message: Any, process: str | None = None) -> bool:
        """A message for the running inferlet's `session.receive` (held until its host exists).
        False when no run of `process` is in progress here (it ended: the message is dropped)."""
        with self._lock:
            if process is None or process != self._process:
                return False
            if self._current is None:
                self._early.append(message)
            else:
                self._current[1].deliver(message)
            return True

    def cancel(self, reason: str = "cancelled by the client") -> bool:
        """Stop the running inferlet at its next host call; its pages return. False: none runs."""
        with self._lock:
            current = self._current
        return current is not None and current[0].cancel(current[1], reason)


def _send_to(controller: Any, sender: str, name: str, message: Any) -> None:
    """session.send_to through the Controller (a control-plane call: the sender learns at once
    that no process has that name)."""
    import ray
    try:
        ray.get(controller.send.remote(name, message, sender))
    except ray.exceptions.RayTaskError as e:
        raise HostOpError(str(e.cause)) from None


def inferlet_actor(**options: Any):
    """The Ray actor class. num_cpus=0: an inferlet mostly waits on the engine, and whole-CPU actors
    would cap a 2-core node at two inferlets. A few threads: `deliver` and `cancel` run while
    `run` streams."""
    import ray
    return ray.remote(num_cpus=0, max_concurrency=4, **options)(InferletActor)
