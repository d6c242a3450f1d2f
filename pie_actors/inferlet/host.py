"""The host side of the inferlet sandbox: wasmtime, the runner component, and the host imports.

How the boundary works (the WIT world is wit/inferlet.wit; the guest half is
sdk/inferlet/_host.py):

* The guest has five imports. ``call(op, args)`` runs a synchronous host operation;
  ``poll(ids)`` / ``wait-any(ids, timeout)`` report which host futures are done;
  ``send(msg)`` streams text to the client; ``compiled(code)`` hands over the main module as the
  runner compiled it, kept for the next run of the same module (compiling it again would cost
  each run ~0.5 ms of CPU a kB of source). Arguments and results are JSON text; anything
  bulky stays on the host behind integer handles.

* ``Sandbox`` turns those imports into calls on a ``HostApi`` object given to each run.
  ``HostApi.call(op, args)`` receives the decoded JSON args and returns a JSON-able value;
  raising ``HostOpError`` (or any exception) hands the guest a ``HostError`` with the
  message. To add a host operation, handle its name in ``call`` -- no WIT change, no
  rebuild of the runner.

* Asynchronous operations return a *future id* minted by ``api.futures.new()``. Whoever does
  the work (an engine connection thread, an asyncio data plane, a timer) later calls
  ``api.futures.resolve(fid, value)`` or ``api.futures.fail(fid, message)`` from any thread.
  The guest's event loop picks the completion up through ``poll`` (while it has other work)
  or blocks in ``wait-any`` (when every task waits), and completes the guest's asyncio
  future for that id with the value, or raises HostError(message) into whoever awaits it.
  Each completion is delivered once, then forgotten.

* Each run gets a fresh wasmtime Store and instance (about a millisecond), limits on its
  memory, tables and instances (``Store.set_limits``: wasmtime bounds none of them by default),
  a wall-clock deadline (epoch interruption driven by a ticker thread; a guest blocked in
  ``wait-any`` is woken at the deadline too) and a bound on what one host call or one ``send``
  may carry (``RunLimits.message_mb``). Whatever goes wrong -- an exception in the inferlet,
  the deadline, a limit, a trap -- ends that run
  only, as ``InferletError(kind, message, guest_traceback)``, and the next run on the same
  Sandbox starts from the clean snapshot. ``HostApi.on_exit`` is called after every run
  (success or not): the place to free the run's KV pages and other host-side state.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from collections import OrderedDict, deque
from functools import partial
from typing import Any, Callable

from ..config import RunLimits
from .build import Artifact, Modules, build_bundle, ensure_runner, shared_engine
from .instance_pool import EXHAUSTED

__all__ = ["Sandbox", "HostApi", "HostOpError", "FutureTable", "Inbox", "InferletError", "limit_store"]

log = logging.getLogger(__name__)

NO_TIMEOUT_MS = 0xFFFFFFFF
HOST_INTERFACE = "pie:inferlet/host@0.1.0"
EPOCH_PERIOD_S = 0.05       # epoch ticker period: deadlines are honored to about this
TICKER_LINGER_S = 1.0       # the ticker outlives the last run this long, for the next run to reuse
MAIN_FILE = "main.py"       # the filename of a main module given as source
CODES_KEPT = 64             # main modules whose compiled code a Sandbox keeps (least recently run go),
CODES_KEPT_CHARS = 32 << 20 # and the most characters of source and code they may hold together
START_WAIT_S = 2.0          # the longest a run waits for a start slot (_STARTS) before it starts anyway

# Runs in their start (instantiation, the runner's and the program's imports, up to the first
# wait on the host) at once in this process, a few a core: wasm runs outside the interpreter lock,
# so a burst of a hundred starts would share the cores a hundred ways and starve the event loop
# that answers their engine connections' handshakes (1,000 sessions launched at once on 2 cores:
# bench/RESULTS.md, "Idle sessions on the cluster"). A start that has not reached its loop within
# START_WAIT_S lets the next one go, so a program that computes before it first waits delays its
# neighbours by that at most.
_STARTS = threading.BoundedSemaphore(4 * (os.cpu_count() or 1))

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class InferletError(Exception):
    """A run of an inferlet that failed.

    kind: "exception" (the inferlet raised), "timeout" (wall-clock deadline), "memory"
    (memory or table limit), "limit" (another bound of RunLimits: a message too large), "trap"
    (the WebAssembly instance trapped, its call stack overflowed, or a host import failed), or
    "cancelled" (stopped from outside: `HostApi.cancel`).
    """

    KINDS = ("exception", "timeout", "memory", "limit", "trap", "cancelled")

    def __init__(self, kind: str, message: str, guest_traceback: str = ""):
        assert kind in self.KINDS, kind
        super().__init__(f"inferlet {kind}: {message}")
        self.kind = kind
        self.message = message
        self.guest_traceback = guest_traceback

    def __str__(self) -> str:
        text = f"inferlet {self.kind}: {self.message}"
        if self.guest_traceback:
            text += "\n" + self.guest_traceback.rstrip()
        return text


class HostOpError(Exception):
    """Raised by a HostApi operation: the guest gets HostError(message)."""


class FutureTable:
    """Host futures of one run: ids minted by the host, completed from any thread, reported
    to the guest once through poll / wait_any."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 1
        self._open: set[int] = set()              # minted, not completed yet
        self._done: dict[int, dict] = {}          # completed, not yet reported to the guest
        self._interrupted = False                 # set by interrupt(): waits return at once
        self.max_open = 0                         # most futures open at once (a concurrency gauge)

    def new(self) -> int:
        with self._cond:
            fid = self._next
            self._next += 1
            self._open.add(fid)
            self.max_open = max(self.max_open, len(self._open))
            return fid

    def _complete(self, fid: int, outcome: dict) -> None:
        with self._cond:
            if fid not in self._open:
                raise KeyError(f"host future {fid} is not open")
            self._open.discard(fid)
            self._done[fid] = outcome
            self._cond.notify_all()

    def resolve(self, fid: int, value: Any = None) -> None:
        """Complete future `fid` with a JSON-able value."""
        self._complete(fid, {"ok": value})

    def fail(self, fid: int, message: str) -> None:
        """Complete future `fid` with an error: the guest's await raises HostError(message)."""
        self._complete(fid, {"err": str(message)})

    def interrupt(self) -> None:
        """Make every wait_any, now and later, return at once (the run is being cancelled)."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def is_open(self, fid: int) -> bool:
        """Whether future `fid` is still to complete."""
        with self._cond:
            return fid in self._open

    def _take(self, ids) -> dict[int, dict]:
        if not self._done:
            return {}
        out = {}
        for fid in ids:
            outcome = self._done.pop(fid, None)
            if outcome is not None:
                out[fid] = outcome
        return out

    def poll(self, ids) -> dict[int, dict]:
        with self._cond:
            return self._take(ids)

    def wait_any(self, ids, timeout: float | None) -> dict[int, dict]:
        """Completions among `ids`, waiting up to `timeout` seconds (None: forever) for one."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                out = self._take(ids)
                if out or self._interrupted:
                    return out
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return {}
                self._cond.wait(left)


def _each(convert: Callable[[Any], Any], items: list) -> list:
    return [convert(item) for item in items]


class Inbox:
    """Items delivered from any thread, matched in order with the guest's receive futures.

    `convert` turns an item into the value a receive future gets (raising fails it); one receive
    may bring its own. A receive or take with `every` gets the list of every item there at once.
    `capacity` bounds what `offer` accepts (items delivered, not yet received); `put` always takes
    the item. After `fail(message)`, waiting and later receives fail with the message. `hold(n)`: a
    waiting receive completes only once `n` items have arrived, so that its reader, woken once,
    finds the next `n - 1` there already."""

    def __init__(self, futures: FutureTable, convert: Callable[[Any], Any] = lambda item: item,
                 capacity: int | None = None) -> None:
        self.futures, self.convert, self.capacity = futures, convert, capacity
        self._items: deque = deque()            # delivered, not yet received
        self._waiting: deque[tuple[int, Callable[[Any], Any], bool]] = deque()   # receives with nothing to get yet
        self._error: str | None = None
        self._lock = threading.Lock()
        self._hold = 1                          # items a waiting receive waits to have arrived

    def put(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            ready = self._match()
        self._settle(ready)

    def offer(self, item: Any) -> bool:
        """`put`, unless `capacity` items wait already: then False, and the item is not taken."""
        with self._lock:
            if self.capacity is not None and len(self._items) >= self.capacity:
                return False
            self._items.append(item)
            ready = self._match()
        self._settle(ready)
        return True

    def fail(self, message: str) -> None:
        with self._lock:
            self._error = message
            ready = self._match()
        self._settle(ready)

    def receive(self, convert: Callable[[Any], Any] | None = None, *, every: bool = False) -> int:
        """A future id that completes with the next item (through `convert`, else the inbox's), or
        with `every`, with the list of every item there once it completes (each through it)."""
        fid = self.futures.new()
        convert = convert or self.convert
        with self._lock:
            self._waiting.append((fid, partial(_each, convert) if every else convert, every))
            ready = self._match()
        self._settle(ready)
        return fid

    def take(self, *, every: bool = False) -> Any:
        """The next item now (with `every`: the list of every item there): LookupError when none has
        arrived, HostOpError when the inbox failed."""
        with self._lock:
            if self._error is not None:
                raise HostOpError(self._error)
            if not self._items:
                raise LookupError("empty")
            return self._take(every)

    def _take(self, every: bool) -> Any:
        if not every:
            return self._items.popleft()
        items = list(self._items)
        self._items.clear()
        return items

    def hold(self, n: int) -> None:
        """Complete a waiting receive only once `n` items have arrived (1: at each item)."""
        with self._lock:
            self._hold = n
            ready = self._match()
        self._settle(ready)

    def clear(self) -> None:
        """Drop the items delivered but not received."""
        with self._lock:
            self._items.clear()

    def _match(self) -> list[tuple[int, Callable[[Any], Any], Any, str | None]]:
        ready = []
        while self._waiting and (len(self._items) >= self._hold or self._error is not None):
            fid, convert, every = self._waiting.popleft()
            ready.append((fid, convert, None, self._error) if self._error is not None
                         else (fid, convert, self._take(every), None))
        return ready

    def _settle(self, ready: list[tuple[int, Callable[[Any], Any], Any, str | None]]) -> None:
        for fid, convert, item, error in ready:
            try:
                if error is None:
                    try:
                        value = convert(item)
                    except Exception as e:
                        error = str(e)
                if error is None:
                    self.futures.resolve(fid, value)
                else:
                    self.futures.fail(fid, error)
            except KeyError:
                pass       # the run is over; nobody waits for it


class HostApi:
    """What an inferlet's host imports do. One instance per run; subclass to connect it.

    Override `call` for host operations, `send` for session output; use `self.futures` for
    asynchronous results (see the module docstring).
    """

    def __init__(self) -> None:
        self.futures = FutureTable()
        self.cancelled: str | None = None      # why the run was cancelled from outside

    def cancel(self, reason: str) -> None:
        """End the run (from any thread, also before it starts) at its next host call or wait; a
        guest computing without calling the host is stopped by its deadline."""
        self.cancelled = reason
        self.futures.interrupt()

    def call(self, op: str, args: Any) -> Any:
        raise HostOpError(f"unknown host operation {op!r}")

    def send(self, message: str) -> None:
        pass

    def on_loop_turn(self, blocking: bool) -> None:
        """The guest's event loop turned: it polls for completions, or (`blocking`) is about to
        block until a host future completes or a timer fires."""

    def output(self, stream: str, data: bytes) -> None:
        """The guest wrote to stdout/stderr (print). Default: onto this process's stderr."""
        sys.stderr.write(data.decode("utf-8", "replace"))

    def on_exit(self, error: InferletError | None) -> None:
        """The run is over (error is None on success): release its host-side resources."""


# ---------------------------------------------------------------------------------------------
# the epoch ticker

class _EpochTicker:
    """Increments the engine's epoch every EPOCH_PERIOD_S while any run is active, and for
    TICKER_LINGER_S after the last one ends: starting its thread took a run's start ~0.07 ms of
    CPU when runs come one after another. One per engine (the epoch is the engine's), shared by
    every Sandbox using that engine."""

    _lock_all = threading.Lock()

    @classmethod
    def of(cls, engine) -> "_EpochTicker":
        with cls._lock_all:
            ticker = getattr(engine, "_pie_epoch_ticker", None)
            if ticker is None:
                ticker = cls(engine)
                engine._pie_epoch_ticker = ticker
            return ticker

    def __init__(self, engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._active = 0
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        idle_ticks = 0
        while True:
            time.sleep(EPOCH_PERIOD_S)
            self.engine.increment_epoch()
            with self._lock:
                idle_ticks = 0 if self._active else idle_ticks + 1
                if idle_ticks * EPOCH_PERIOD_S >= TICKER_LINGER_S:
                    self._thread = None
                    return

    def acquire(self) -> None:
        with self._lock:
            self._active += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="pie-epoch", daemon=True)
                self._thread.start()

    def release(self) -> None:
        with self._lock:
            self._active -= 1


# ---------------------------------------------------------------------------------------------
# the sandbox

class _Deadline(Exception):
    pass


class _Run:
    """State of one run, seen by the host imports (through a thread-local)."""

    def __init__(self, api: HostApi, limits: RunLimits):
        self.api = api
        self.timeout = limits.timeout_s
        self.deadline = time.monotonic() + limits.timeout_s
        self.max_text = limits.message_mb << 20     # characters one call's args or one send may hold
        self.failure: InferletError | None = None
        self.stderr_tail = ""                     # the guest's last stderr output, for trap reports
        # The main module's compiled code is taken from the run's first host call only: the
        # runner's, made before any of the inferlet's code runs (wit: `compiled`).
        self.code_wanted = False
        self.code: str | None = None
        self.start_slot = False                   # it holds one of _STARTS

    def started(self) -> None:
        """The run reached its loop (or ended): its start slot goes to the next run."""
        if self.start_slot:
            self.start_slot = False
            _STARTS.release()

    def output(self, stream: str, data: bytes) -> None:
        if stream == "stderr":
            self.stderr_tail = (self.stderr_tail + data.decode("utf-8", "replace"))[-4000:]
        self.api.output(stream, data)


# the host imports (wrapped by Sandbox._import): each gets the run's state first

def _call(run: _Run, op: str, args: str):
    from wasmtime.component import Variant

    if run.api.cancelled is not None:
        raise _Deadline()
    if len(args) > run.max_text:         # refused before the host parses (and holds) it
        return Variant("err", f"{op}: arguments of {len(args)} characters exceed the run's limit of "
                              f"{run.max_text} (limits.message_mb)")
    try:
        result = run.api.call(op, json.loads(args))
        return Variant("ok", _dumps(result))
    except (InferletError, _Deadline):
        raise
    except HostOpError as e:
        return Variant("err", str(e))
    except Exception as e:
        return Variant("err", f"{type(e).__name__}: {e}")


def _poll(run: _Run, ids: str) -> str:
    if run.api.cancelled is not None:
        raise _Deadline()
    run.started()
    run.api.on_loop_turn(False)
    return _dumps({str(k): v for k, v in run.api.futures.poll(json.loads(ids)).items()})


def _wait_any(run: _Run, ids: str, timeout_ms: int) -> str:
    left = run.deadline - time.monotonic()
    if left <= 0 or run.api.cancelled is not None:
        raise _Deadline()
    wait = left if timeout_ms == NO_TIMEOUT_MS else min(left, timeout_ms / 1000)
    run.started()
    ids = json.loads(ids)
    done = run.api.futures.poll(ids)
    run.api.on_loop_turn(not done)
    if not done:
        done = run.api.futures.wait_any(ids, wait)
    if run.api.cancelled is not None or (not done and time.monotonic() >= run.deadline):
        raise _Deadline()
    return _dumps({str(k): v for k, v in done.items()})


def _send(run: _Run, msg: str) -> None:
    if run.api.cancelled is not None:      # a guest that only sends still stops when it is cancelled
        raise _Deadline()
    if len(msg) > run.max_text:
        raise InferletError("limit", f"session.send of {len(msg)} characters exceeds the run's limit of "
                                     f"{run.max_text} (limits.message_mb)")
    run.api.send(msg)


def _compiled(run: _Run, code: str) -> None:
    if run.code_wanted:
        run.code = code


def _main_module(source: str, bundle: Modules | None) -> tuple[str, str] | None:
    """(filename, source) of the main module a run executes, where the host knows it (a bundle
    component's is baked in, compiled)."""
    if source:
        return MAIN_FILE, source
    entry = bundle.get("main") if bundle else None
    return (entry[0], entry[2]) if entry else None


def _instantiation_error(e: Exception) -> InferletError:
    text = str(e)
    if EXHAUSTED in text:      # every slot of the process's instance pool is taken
        return InferletError("limit", f"too many inferlets at once in this process: {text.splitlines()[0]}")
    # "... exceeds memory limits", "... table limits": the run's RunLimits
    kind = "memory" if "limits" in text else "trap"
    return InferletError(kind, f"could not instantiate the inferlet component: {text}")


def limit_store(store, limits: RunLimits) -> None:
    """Bound what a guest in `store` may take: its linear memory, table elements, instances,
    tables and memories (past a bound, memory.grow and table.grow fail; instantiation too)."""
    store.set_limits(memory_size=limits.memory_mb << 20, table_elements=limits.table_elements,
                     instances=limits.instances, tables=limits.tables, memories=limits.memories)


class Sandbox:
    """Runs inferlets in fresh instances of one compiled component.

    `bundle`: a bundle folder (see build.build_bundle); None for the shared runner. `limits`
    (RunLimits: deadline, memory, tables, message size) are defaults that each run may override. Runs
    may happen concurrently on different threads. `engine`: the wasmtime Engine to compile and run
    in (default: the process's pooled one, build.shared_engine). `codes_kept`: how many main
    modules' compiled code it keeps for their next runs (0: each run compiles its own). `runner`:
    the runner component's artifact for an engine (build.ensure_js_runner: JavaScript's).
    """

    def __init__(self, bundle=None, *, limits: RunLimits | None = None, engine=None,
                 codes_kept: int = CODES_KEPT, runner: Callable[[Any], Artifact] = ensure_runner):
        import wasmtime
        from wasmtime.component import Component, Linker

        from .wasm_imports import RESULT, STRING, U32, add_func

        self._wasmtime = wasmtime
        self.engine = engine or shared_engine()
        self.limits = limits or RunLimits()
        self.is_runner = bundle is None        # the plain runner: a bundle's modules come with each run
        self.artifact: Artifact = (build_bundle(bundle, self.engine) if bundle is not None
                                   else runner(self.engine))
        t0 = time.perf_counter()
        self.component = Component.deserialize_file(self.engine, str(self.artifact.path))
        self.deserialize_s = time.perf_counter() - t0
        self._ticker = _EpochTicker.of(self.engine)
        self._tls = threading.local()
        self.linker = Linker(self.engine)
        self.linker.add_wasip2()
        with self.linker.root() as root:
            with root.add_instance(HOST_INTERFACE) as host:
                add_func(host, "call", self._import(_call), (STRING, STRING), RESULT)
                add_func(host, "poll", self._import(_poll), (STRING,), STRING)
                add_func(host, "wait-any", self._import(_wait_any), (STRING, U32), STRING)
                add_func(host, "send", self._import(_send), (STRING,), None)
                add_func(host, "compiled", self._import(_compiled), (STRING,), None)
        self._codes: OrderedDict[tuple[str, str], str] = OrderedDict()   # main module -> its code
        self._codes_kept = codes_kept
        self._codes_chars = 0
        self._codes_lock = threading.Lock()

    @property
    def from_cache(self) -> bool:
        """Whether the compiled component came from the cache (nothing built or compiled)."""
        return self.artifact.from_cache

    # -- host imports ---------------------------------------------------------------------------

    def _import(self, fn):
        """Wrap a host import: any failure ends the run, recorded for run() to report.
        Raising WasmtimeError (not a Python exception) unwinds the guest as a trap without
        going through wasmtime-py's process-global "last exception" slot, which concurrent
        runs on other threads would share. (The closure holds no reference to the Sandbox:
        wasmtime-py keeps host functions in a process-global table.)"""
        WasmtimeError = self._wasmtime.WasmtimeError
        tls = self._tls

        def host_import(store, *args):
            run: _Run = tls.run
            try:
                return fn(run, *args)
            except _Deadline:
                run.failure = (InferletError("cancelled", run.api.cancelled) if run.api.cancelled is not None
                               else InferletError("timeout", f"deadline of {run.timeout:.3g} s "
                                                             "passed while waiting on the host"))
            except InferletError as e:
                run.failure = e
            except Exception as e:
                run.failure = InferletError("trap", f"host import {fn.__name__.lstrip('_')} "
                                                    f"failed: {type(e).__name__}: {e}")
            finally:
                run.code_wanted = False
            raise WasmtimeError(run.failure.message)

        return host_import

    # -- running --------------------------------------------------------------------------------

    def run(self, source: str, input: Any = None, api: HostApi | None = None, *,
            limits: RunLimits | None = None, stats: dict | None = None, bundle: Modules | None = None) -> Any:
        """Run an inferlet: `source` is its main module (empty: a bundle's main.py), `input`
        the JSON-able value given to `main`. Returns main's result; raises InferletError.
        `bundle`: a bundle's modules (build.bundle_modules) for the plain runner to import from.
        `stats`, when given, receives main_cached, whether the run was handed its main module
        compiled by an earlier run (a Sandbox keeps what the runner compiled, for the next run of
        the same module), and once the run has succeeded its timings: instantiate_s and run_s."""
        from wasmtime.component import Variant

        wasmtime = self._wasmtime
        api = api if api is not None else HostApi()
        limits = limits or self.limits
        timeout = limits.timeout_s
        run = _Run(api, limits)
        error: InferletError | None = None
        store = None
        run.start_slot = _STARTS.acquire(timeout=START_WAIT_S)
        self._ticker.acquire()
        self._tls.run = run
        try:
            t0 = time.perf_counter()
            store = wasmtime.Store(self.engine)
            wasi = wasmtime.WasiConfig()
            wasi.stdout_custom = lambda data: run.output("stdout", data)
            wasi.stderr_custom = lambda data: run.output("stderr", data)
            store.set_wasi(wasi)
            limit_store(store, limits)
            store.set_epoch_deadline(int(timeout / EPOCH_PERIOD_S) + 1)
            # Each failure is raised outside its `except`: a wasmtime error's traceback holds the
            # frames that were given the store, so an InferletError with it as __context__ would keep
            # the whole instance (its linear memory, ~10 MiB) alive for as long as the error is held.
            # And wasmtime-py's frame that raised it holds the error and the store, a cycle that would
            # keep the instance (its pool slot) until a collection: its frames are cleared when caught.
            trap = None
            try:
                instance = self.linker.instantiate(store, self.component)
            except wasmtime.WasmtimeError as e:
                trap = _instantiation_error(e)
                traceback.clear_frames(e.__traceback__)
            if trap is not None:
                raise trap
            func = instance.get_func(store, "run")
            main = _main_module(source, bundle)
            code = self._code_of(main)
            run.code_wanted = main is not None and code is None
            if stats is not None:
                stats["main_cached"] = code is not None
            t1 = time.perf_counter()
            try:
                out = func(store, source, code or "", _dumps(input), _dumps(bundle) if bundle else "")
            except wasmtime.WasmtimeError as e:
                trap = self._classify_trap(run, e, timeout)
                traceback.clear_frames(e.__traceback__)
            if run.code is not None:
                self._keep_code(main, run.code)
            if trap is not None:
                raise trap
            t2 = time.perf_counter()
            if stats is not None:
                stats.update(instantiate_s=t1 - t0, run_s=t2 - t1)
            assert isinstance(out, Variant), out
            if out.tag == "ok":
                return json.loads(out.payload)
            try:
                info = json.loads(out.payload)
                kind, message, tb = info["kind"], info["message"], info.get("traceback", "")
            except (ValueError, KeyError, TypeError):
                kind, message, tb = "exception", str(out.payload), ""
            raise InferletError(kind if kind in InferletError.KINDS else "exception", message, tb)
        except InferletError as e:
            error = e
            raise
        except BaseException as e:  # a failure of the host itself; the run is over all the same
            error = InferletError("trap", f"host failure: {type(e).__name__}: {e}")
            raise
        finally:
            run.started()
            self._tls.run = None
            self._ticker.release()
            del store  # the instance and its memory go with the store
            try:
                api.on_exit(error)
            except Exception:
                log.exception("HostApi.on_exit failed")
            # A raised error's traceback holds this frame, and the error lives on in its Process:
            # without these locals the run's host and state do not live on with it (in the suite,
            # leaving them kept two failed runs' stores alive past a full collection).
            run = error = api = None

    def _code_of(self, main: tuple[str, str] | None) -> str | None:
        """The compiled code an earlier run handed over for main module (filename, source)."""
        if main is None:
            return None
        with self._codes_lock:
            code = self._codes.get(main)
            if code is not None:
                self._codes.move_to_end(main)
            return code

    def _keep_code(self, main: tuple[str, str], code: str) -> None:
        with self._codes_lock:
            if main not in self._codes:
                self._codes[main] = code
                self._codes_chars += len(main[1]) + len(code)
            while self._codes and (len(self._codes) > self._codes_kept or self._codes_chars > CODES_KEPT_CHARS):
                (_, source), old = self._codes.popitem(last=False)
                self._codes_chars -= len(source) + len(old)

    def _classify_trap(self, run: _Run, e: Exception, timeout: float) -> InferletError:
        if run.failure is not None:                 # a host import ended the run
            return run.failure
        text = str(e)
        # wasmtime's message is a wasm backtrace, then "Caused by:" and the trap itself
        cause = text.rsplit("Caused by:", 1)[-1].strip() or text
        if "interrupt" in cause:                     # epoch deadline reached while computing
            # the wasm backtrace says nothing useful about the Python code that was running
            return InferletError("timeout", f"deadline of {timeout:.3g} s passed")
        if "MemoryError" in run.stderr_tail or "out of memory" in run.stderr_tail.lower():
            # CPython gave up after an allocation failed at the memory limit
            return InferletError("memory", "the inferlet ran out of memory",
                                 (run.stderr_tail + "\n" + text).strip())
        detail = (run.stderr_tail + "\n" + text).strip()
        if "call stack exhausted" in cause:           # wasmtime's stack bound (Config.max_wasm_stack)
            return InferletError("trap", "the inferlet exhausted its call stack (recursion too deep)", detail)
        if isinstance(e, self._wasmtime.ExitTrap):
            return InferletError("trap", f"the inferlet exited with status {e.code}", detail)
        return InferletError("trap", cause.splitlines()[0], detail)
