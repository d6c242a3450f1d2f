"""The engine in a process of its own, for a runtime without Ray (`Runtime.local(engine_process=True)`).

In one process, the engine's thread shares the interpreter lock with every program's host work and
the HTTP layer: each of the eager forward's torch ops lets go of the lock and has to win it back.
Here the engine and its data-plane server run in a child process with a lock of their own, as
vLLM runs its engine core apart from its API server; programs reach it over the data plane as
they reach an engine actor. The few control calls (stats, saved working sets) go over a pipe.
The child ends with its parent: when the pipe closes, it stops serving.

A child can die under its parent (the kernel's OOM killer, a crash in native code). `RestartingEngine`
sees it at once (the process's sentinel), says so, and starts another child, with backoff, as Ray
restarts an engine actor on a cluster; the dead engine's KV pages and saved working sets are gone.
"""
from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from ...config import EngineConfig
from . import wire

START_S = 600.0             # a model's load, and its compiled decode's warm-up
STEADY_S = 60.0             # a child that served this long before it died is started again at once
MAX_BACKOFF_S = 30.0        # the longest wait before another start, after children that died young

log = logging.getLogger("pie.engine")


class EngineDown(RuntimeError):
    """No engine serves: its process died, and the next one has not started (yet)."""


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
        self._reaping = threading.Lock()
        if not self._pipe.poll(START_S):
            self.close()
            raise TimeoutError(f"the engine process did not start within {START_S:.0f} s")
        self.address: wire.EngineAddress = self._answer()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def sentinel(self) -> int:
        """A handle that becomes ready when the child ends (multiprocessing.connection.wait)."""
        return self._process.sentinel

    def death(self) -> str:
        """Why it ended (once it has)."""
        with self._reaping:      # a second join at once would find the child reaped, its exit code unread
            self._process.join()
        return f"the engine process died (exit code {self._process.exitcode})"

    def stats(self) -> wire.Stats:
        return self._call("stats")

    def list_saved(self, owner: str | None) -> list[dict]:
        return self._call("list_saved", owner)

    def delete_saved(self, name: str, owner: str | None) -> None:
        self._call("delete_saved", name, owner)

    def kill(self) -> None:
        """End the child at once, from any thread (one still starting too: its start then fails)."""
        self._process.kill()

    def close(self) -> None:
        """Stop the engine; its process ends."""
        with self._reaping:
            if self._process.is_alive():
                with self._lock:
                    self._pipe.close()             # the child's recv ends: it stops serving
                self._process.join(30)
            if self._process.is_alive():
                self._process.kill()
            self._process.join()
        self._pipe.close()

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            try:
                self._pipe.send((name, args))
            except OSError:                        # a child that died, or a pipe closed here
                raise EngineDown(f"the engine process ended (exit code {self._process.exitcode})") from None
            return self._answer()

    def _answer(self) -> Any:
        try:
            ok, value = self._pipe.recv()
        except (EOFError, OSError):
            self._process.join(5)                  # it closed its end of the pipe: it is ending
            raise EngineDown(f"the engine process ended (exit code {self._process.exitcode})") from None
        if not ok:
            raise value
        return value


class RestartingEngine:
    """An EngineProcess started again whenever it dies, with backoff: at once after one that served
    for STEADY_S, else after waits that double up to MAX_BACKOFF_S; `serving` waits for an engine.
    The runs on a dead engine learn of it from their connections (inferlet/engine_client.py)."""

    def __init__(self, config: EngineConfig, long_lived: bool) -> None:
        self._config, self._long_lived = config, long_lived
        self._engine = EngineProcess(config, long_lived)   # the first start's failure is the caller's
        self.down: str | None = None                       # why no engine serves now (None: one does)
        self.restarts = 0                                  # engines started after a death, that served
        self.backoffs: list[float] = []                    # the wait before each start after a death, in order
        self._deaths: dict[wire.EngineAddress, str] = {}   # the dead engines' addresses, and why they died
        self._starting = False                             # the watcher is starting another
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="pie-engine-watch", daemon=True)
        self._watcher.start()

    @property
    def engine(self) -> EngineProcess:
        """The engine that serves now; EngineDown while none does."""
        with self._changed:
            if self.down is not None:
                raise EngineDown(f"{self.down}; another is starting")
            return self._engine

    def serving(self, timeout: float | None) -> EngineProcess:
        """The engine that serves, once one does (up to `timeout` seconds: else EngineDown)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.down is None or self._closed.is_set(), timeout):
                raise EngineDown(f"{self.down}; no other served within {timeout:.0f} s")
            if self._closed.is_set():
                raise EngineDown("the runtime closed")
            return self._engine

    def died(self, address: wire.EngineAddress) -> str | None:
        """Why the engine at `address` died, if it has, seen at once (before the watcher does too)."""
        with self._changed:
            engine, reason = self._engine, self._deaths.get(address)
        if reason is None and engine.address == address and wait([engine.sentinel], 0):
            reason = engine.death()
            with self._changed:
                if self._engine is engine:               # down before the run that saw it ends
                    self.down = self.down or reason
        return reason

    def stats(self) -> wire.Stats:
        return self.engine.stats()

    def list_saved(self, owner: str | None) -> list[dict]:
        return self.engine.list_saved(owner)

    def delete_saved(self, name: str, owner: str | None) -> None:
        self.engine.delete_saved(name, owner)

    def close(self) -> None:
        """Stop the engine. One being started is stopped by the watcher once it has started."""
        with self._changed:
            self._closed.set()
            self._changed.notify_all()
            engine, starting = self._engine, self._starting
        engine.close()
        if not starting:
            self._watcher.join()

    def _watch(self) -> None:
        backoff = 0.0
        while True:
            engine, started = self._engine, time.monotonic()
            wait([engine.sentinel])
            if self._closed.is_set():
                return
            reason = engine.death()
            log.error("%s; starting another", reason)
            with self._changed:
                self.down, self._starting, self._deaths[engine.address] = reason, True, reason
            engine.close()
            backoff = 0.0 if time.monotonic() - started >= STEADY_S else _longer(backoff)
            while (engine := self._start(backoff)) is None:
                if self._closed.is_set():
                    return
                backoff = _longer(backoff)
            with self._changed:
                closed = self._closed.is_set()
                if not closed:
                    self._engine, self._starting, self.down = engine, False, None
                    self.restarts += 1
                    self._changed.notify_all()
            if closed:
                engine.close()
                return
            log.warning("the engine serves again (process %d)", engine.pid)

    def _start(self, backoff: float) -> EngineProcess | None:
        """A new engine after `backoff` seconds; None when it did not start or the runtime closed."""
        self.backoffs.append(backoff)
        if self._closed.wait(backoff):
            return None
        try:
            return EngineProcess(self._config, self._long_lived)
        except Exception as e:
            log.error("the engine process did not start again: %s: %s", type(e).__name__, e)
            return None


def _longer(backoff: float) -> float:
    """The wait after `backoff` when the engine started after it dies young (or does not start)."""
    return min(max(1.0, 2 * backoff), MAX_BACKOFF_S)


def _serve(config: EngineConfig, long_lived: bool, pipe: Any) -> None:
    from .data_plane import serve_model

    try:
        server, address = serve_model(config, long_lived=long_lived, own_process=True)
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
