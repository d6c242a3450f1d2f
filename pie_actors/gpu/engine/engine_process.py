"""The engine in a process of its own, for a runtime without Ray (`Runtime.local(engine_process=True)`).

In one process, the engine's thread shares the interpreter lock with every program's host work and
the HTTP layer: each of the eager forward's torch ops lets go of the lock and has to win it back.
Here the engine and its data-plane server run in a child process with a lock of their own, as
vLLM runs its engine core apart from its API server; programs reach it over the data plane as
they reach an engine actor. The few control calls (stats, saved working sets) go over a pipe.
The child ends with its parent: when the pipe closes, it stops serving.
"""
from __future__ import annotations

import multiprocessing
import threading
from typing import Any

from ...config import EngineConfig
from . import wire

START_S = 600.0             # a model's load, and its compiled decode's warm-up


class EngineProcess:
    """An engine served from a child process: `address` for the data plane, and the calls a
    local runtime makes of its engine's server."""

    def __init__(self, config: EngineConfig, long_lived: bool = False) -> None:
        context = multiprocessing.get_context("spawn")      # a forked child would inherit the threads' locks
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(config, long_lived, child), name="pie-engine",
                                        daemon=True)
        self._process.start()
        child.close()
        self._lock = threading.Lock()
        if not self._pipe.poll(START_S):
            self.close()
            raise TimeoutError(f"the engine process did not start within {START_S:.0f} s")
        self.address: wire.EngineAddress = self._answer()

    def stats(self) -> wire.Stats:
        return self._call("stats")

    def list_saved(self, owner: str | None) -> list[dict]:
        return self._call("list_saved", owner)

    def delete_saved(self, name: str, owner: str | None) -> None:
        self._call("delete_saved", name, owner)

    def close(self) -> None:
        """Stop the engine; its process ends."""
        if self._process.is_alive():
            with self._lock:
                self._pipe.close()                 # the child's recv ends: it stops serving
            self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            self._pipe.send((name, args))
            return self._answer()

    def _answer(self) -> Any:
        try:
            ok, value = self._pipe.recv()
        except EOFError:
            raise RuntimeError(f"the engine process ended (exit code {self._process.exitcode})") from None
        if not ok:
            raise value
        return value


def _serve(config: EngineConfig, long_lived: bool, pipe: Any) -> None:
    from .data_plane import serve_model

    try:
        server, address = serve_model(config, long_lived=long_lived)
    except BaseException as e:
        pipe.send((False, e))
        return
    calls = {"stats": server.stats, "list_saved": server.engine.list_saved,
             "delete_saved": server.engine.delete_saved}
    pipe.send((True, address))
    try:
        while True:
            try:
                name, args = pipe.recv()
            except EOFError:                       # the parent closed the pipe, or ended
                return
            try:
                pipe.send((True, calls[name](*args)))
            except Exception as e:
                pipe.send((False, e))
    finally:
        server.close()
        server.engine.close()
