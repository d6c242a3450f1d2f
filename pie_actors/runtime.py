"""The launch API: start inferlets and follow them, in this process or on a Ray cluster, the same way.

    with Runtime.local() as runtime:          # engine, data plane and sandbox here, no Ray
        process = runtime.launch("examples/quickstart/main.py", {"question": "What is 2 + 2?"})
        for event in process.events():        # Send(text) ... then Done(output) or Failed(...)
            ...

`Runtime.connect()` gives the same interface on a Ray cluster: it joins the cluster at `address`,
RAY_ADDRESS or the one running on this machine (or starts one for itself), asks the cluster's
Controller for the model's engine, and runs each launch on an inferlet host actor with room. Every front
door (`pie run`, the benches, the tests) starts programs here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
from functools import partial
from typing import Any, Callable

from . import cpu_cores
from .config import Config, RunLimits, load
from .gpu.engine.wire import EngineAddress
from .inferlet.peers import GONE, Endings, UnknownProcess, ending
from .kvstore import UnknownSaved
from .launch import Launch
from .process import Done, Failed, Process
from .program import Program
from .replicas import EngineGone

__all__ = ["Runtime"]

log = logging.getLogger(__name__)

START_WAIT_S = 30.0          # the longest a launcher's message waits for its process's run to begin
RELAUNCH_WAIT_S = 30.0       # the longest a restartable run waits for the Controller to free its name


class Runtime:
    """Launches programs on one model's engine. A context manager: `close` stops what it started."""

    def __init__(self, backend: _Local | _Cluster, config: Config) -> None:
        self._backend, self.config = backend, config

    @classmethod
    def local(cls, model: str | None = None, *, long_lived: bool = False, engine_process: bool = False,
              **settings: Any) -> Runtime:
        """Everything in this process, no Ray: the engine for `model` (default: the configured one),
        its data plane on a local port, and the sandbox. `settings` override the config by name
        (`dtype="float32"`, `timeout_s=60`, ...). `long_lived`: the runtime will serve for long (a
        server), so compile "auto" compiles its engine. `engine_process`: the engine runs in a
        child process instead (gpu/engine/engine_process.py), out of the programs' interpreter lock;
        `engine` is then not available. If that process dies, the runs on it fail with the reason,
        another is started, launches wait for it (up to their timeout), and the programs that
        called `runtime.declare_restartable()` run again on it."""
        config = load(model=model, **settings)
        return cls(_Local(config, long_lived, engine_process), config)

    @classmethod
    def connect(cls, address: str | None = None, **settings: Any) -> Runtime:
        """The Ray cluster at `address` (else RAY_ADDRESS, else the one running here, else a new
        local one, stopped again by `close`) and its Controller, which starts the model's engine
        on first use. Asking for other engine settings than the running engine's is an error."""
        config = load(**settings)
        return cls(_Cluster(config, address), config)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def launch(self, program: Any, input: Any = None, *, name: str | None = None,
               files: dict[str, bytes] | None = None, timeout: float | None = None,
               owner: str | None = None, node: str | None = None, limits: RunLimits | None = None) -> Process:
        """Start `program` (a .py file, a bundle folder or source text) on `input` (main's argument,
        {} by default). `name`: the process name other inferlets' `session.send_to` use (one is made
        up otherwise; a name in use is a ValueError). `files`: what `session.file(name)` reads.
        `timeout`: its wall-clock limit in seconds (default: the config's timeout_s). `owner`: whose
        process it is (pie serve passes its client's key; None: this machine's user). Names are per
        owner, and `session.send_to` reaches only processes of the sender's owner. `node`: the Ray
        node (id or IP) to run it on (Runtime.connect only). `limits`: the run's bounds, in place of
        the config's (an inferlet's children get their parent's)."""
        limits = limits or self.config.limits
        if timeout is not None:
            limits = dataclasses.replace(limits, timeout_s=timeout)
        return self.start(Launch(Program.load(program), {} if input is None else input, dict(files or {}),
                                 limits, owner, name, node))

    def start(self, launch: Launch) -> Process:
        """Start a launch built already (what `launch` does once it has built one; a parent's
        `runtime.spawn` starts its child's here)."""
        cpu_cores.keep_off()       # this process's threads (the sandboxes', pie serve's) off a CPU engine's cores
        return self._backend.launch(launch)

    def saved(self, owner: str | None = None) -> list[dict[str, Any]]:
        """The working sets `owner`'s processes saved (`ws.save(name)`): {"name", "state" ("kept":
        in the page pool, "spilled": in host memory, "tokens": to be recomputed), "tokens"}, by name."""
        return self._backend.saved(owner)

    def delete_saved(self, name: str, owner: str | None = None) -> None:
        """Forget `owner`'s saved working set `name`; its KV pages and host memory return. An
        unknown name is a KeyError."""
        self._backend.delete_saved(name, owner)

    def stats(self) -> dict[str, Any]:
        """The engine's figures (`batch_sizes`: lanes per executed batch -> batches; `kv`: total,
        free, referenced and cached pages; connections, sequences, channels, programs) and
        `processes`, the number of this model's programs running."""
        return self._backend.stats()

    def running(self, owner: str | None = None) -> int:
        """How many of `owner`'s programs run now: launched, and not yet ended (pie serve's quotas)."""
        return self._backend.running(owner)

    @property
    def engine_address(self) -> EngineAddress:
        """The engine's data-plane address and secret (for EngineClient connections)."""
        return self._backend.address

    @property
    def engine_down(self) -> str | None:
        """Why the engine does not serve now: its process died and another is starting
        (Runtime.local with engine_process); None while it serves."""
        return self._backend.engine_down if isinstance(self._backend, _Local) else None

    @property
    def engine_restarts(self) -> int:
        """How many times another engine process served after one died (Runtime.local with
        engine_process; 0 otherwise)."""
        restarting = self._backend.restarting if isinstance(self._backend, _Local) else None
        return 0 if restarting is None else restarting.restarts

    @property
    def engine(self):
        """The in-process Engine (Runtime.local only), for tests and benchmarks that look inside."""
        if not isinstance(self._backend, _Local):
            raise AttributeError("a Runtime.connect() runtime's engine runs in its own actor: use stats()")
        if self._backend.engine is None:
            raise AttributeError("this runtime's engine runs in its own process (engine_process=True): use stats()")
        return self._backend.engine

    def close(self) -> None:
        """Stop this runtime's running programs (local) and what it started."""
        self._backend.close()
        cpu_cores.keep_off()       # back onto the cores its engine had, once that has ended


# ---- in this process -----------------------------------------------------------------------------

class _Local:
    def __init__(self, config: Config, long_lived: bool, engine_process: bool = False) -> None:
        from .gpu.engine.data_plane import serve_model

        # the sandbox's runner component loads (or, on a machine's first start, builds: about 30 s on
        # 2 cores) while the engine does, not at the first launch
        runner = threading.Thread(target=_load_runner, name="pie-runner", daemon=True)
        runner.start()
        self.restarting = None       # the engine's child process, started again when it dies (engine_process)
        if engine_process:
            from .gpu.engine.engine_process import RestartingEngine

            self.server = self.saved_sets = self.restarting = RestartingEngine(config.engine, long_lived)
            self.engine = None
        else:
            self.server, self._address = serve_model(config.engine, long_lived=long_lived)
            self.engine = self.saved_sets = self.server.engine
        self.model = config.engine.model
        if long_lived:
            from .inferlet.run_state import model_tokenizer
            from .model_store import resolve_model
            model_tokenizer(str(resolve_model(self.model)))       # under the path runs are told (wire.Info)
        self.runs: dict[tuple[str | None, str], Any] = {}   # (owner, process name) -> its Run, while it runs
        self.endings = Endings()                             # how the ones that ended lately ended
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        runner.join()

    @property
    def address(self) -> EngineAddress:
        return self._address if self.restarting is None else self.restarting.engine.address

    def serving(self, timeout: float | None) -> EngineAddress:
        """The address of the engine that serves, waiting up to `timeout` s for one started again."""
        return self._address if self.restarting is None else self.restarting.serving(timeout).address

    @property
    def engine_down(self) -> str | None:
        """Why no engine serves now: its process died, another is starting (None: one serves)."""
        return None if self.restarting is None else self.restarting.down

    def launch(self, launch: Launch) -> Process:
        if launch.node is not None:
            raise ValueError(f"node={launch.node!r}: Runtime.local runs everything in this process (placement "
                             "on a node needs a Ray cluster: Runtime.connect, pie run without --local)")
        owner, name = launch.owner, launch.name
        with self._lock:
            if name is not None and (owner, name) in self.runs:
                raise ValueError(f"a process named {name!r} is already running")
            while name is None or (owner, name) in self.runs:
                name = f"inferlet-{next(self._numbers)}"
            self.runs[(owner, name)] = None           # taken; the Run comes next
        launch = dataclasses.replace(launch, name=name)
        try:
            return self._run(launch, self.serving(launch.limits.timeout_s))
        except BaseException:
            with self._lock:
                self.runs.pop((owner, name), None)
            raise

    def _run(self, launch: Launch, address: EngineAddress, process: Process | None = None) -> Process:
        """Run `launch` on the engine at `address`, as a new Process or as `process` again. A run
        whose engine process died under it fails with that reason, or, restartable, runs again
        (while its `restarts` allow) on the engine started after it."""
        from .inferlet.run import Run

        key, peers = launch.key, _LocalPeers(self, launch.owner, launch.name)

        def emit(event: Any) -> None:
            if isinstance(event, Failed) and (died := self._died(address)) is not None:
                event = Failed("trap", died, tokens=event.tokens)
                if peers.restartable and launch.limits.restarts > 0:
                    if (event := self._again(process, launch, event)) is None:
                        return
            if isinstance(event, (Done, Failed)):
                with self._lock:
                    self.runs.pop(key, None)
                    self.endings.note(key, ending(event))
            process.emit(event)

        run = Run(launch, address, emit, peers)
        if process is None:
            process = Process(launch.name, run)
        else:
            process.relaunched(run)
        with self._lock:
            self.runs[key] = run
        run.start()
        return process

    def _again(self, process: Process, launch: Launch, failed: Failed) -> Failed | None:
        """Run a restartable process again once an engine serves: None once it started again,
        else `failed`, saying why not."""
        limits = dataclasses.replace(launch.limits, restarts=launch.limits.restarts - 1)
        try:
            self._run(dataclasses.replace(launch, limits=limits), self.serving(limits.timeout_s), process)
            return None
        except Exception as e:
            return dataclasses.replace(failed, message=f"{failed.message} (not restarted: {type(e).__name__}: {e})")

    def _died(self, address: EngineAddress) -> str | None:
        """Why the engine at `address` died, if it has (None: it serves, or is this process's)."""
        return None if self.restarting is None else self.restarting.died(address)

    def find(self, owner: str | None, name: str) -> Any:
        """The Run of `owner`'s running process `name`; UnknownProcess when there is none."""
        with self._lock:
            run = self.runs.get((owner, name))
            if run is None:
                raise UnknownProcess(self.endings.not_running((owner, name), [n for o, n in self.runs if o == owner]))
        return run

    def saved(self, owner: str | None) -> list[dict[str, Any]]:
        return self.saved_sets.list_saved(owner)

    def delete_saved(self, name: str, owner: str | None) -> None:
        try:
            self.saved_sets.delete_saved(name, owner)
        except UnknownSaved as e:
            raise KeyError(str(e)) from None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.server.stats(), "processes": len(self.runs)}

    def running(self, owner: str | None) -> int:
        with self._lock:
            return sum(o == owner for o, _ in self.runs)

    def close(self) -> None:
        with self._lock:
            runs = [r for r in self.runs.values() if r is not None]
        for run in runs:
            run.cancel("the runtime closed")
        self.server.close()
        if self.engine is not None:
            self.engine.close()


def _load_runner() -> None:
    from .inferlet.run import sandbox_for

    try:
        sandbox_for(Program())
    except Exception:           # the first launch meets the same failure, and reports it
        log.exception("the sandbox's runner component could not be loaded")


class _LocalPeers:
    """The `Peers` (inferlet/peers.py) of process `sender` of `owner` in a local runtime."""

    def __init__(self, local: _Local, owner: str | None, sender: str) -> None:
        self.local, self.owner, self.sender = local, owner, sender
        self.restartable = False

    def deliver(self, name: str, message: Any, timeout: float) -> bool:
        return self.local.find(self.owner, name).deliver(message, self.sender)

    def launch(self, launch: Launch, model: str | None) -> Process:
        if model is not None and model != self.local.model:
            raise ValueError(f"model={model!r}: this runtime serves {self.local.model!r} only")
        return self.local.launch(launch)

    def running(self) -> int:
        return self.local.running(self.owner)

    def declare_restartable(self) -> None:
        """Noted: the process runs again if the engine's process dies under it (engine_process)."""
        self.restartable = True


# ---- on a Ray cluster ----------------------------------------------------------------------------

class _ActorControl:
    """A process's control (see process.Control) through its InferletActor; `key` is the
    process's (owner, name). Messages and files go out one at a time, in order, from the runtime's
    `loop`: Ray keeps no order among one caller's calls to a threaded actor (see peers.py), and one
    that reaches the actor before its run has begun is sent again until it has (START_WAIT_S at most)."""

    def __init__(self, actor: Any, key: tuple[str | None, str], loop: asyncio.AbstractEventLoop) -> None:
        self.actor, self.key, self.loop = actor, key, loop
        self._last: Any = None                  # the delivery sent before, as a concurrent Future
        self._lock = threading.Lock()

    def deliver(self, message: Any) -> None:
        self._in_order(self.actor.deliver, message)

    def deliver_file(self, data: bytes) -> None:
        self._in_order(self.actor.deliver_file, data)

    def _in_order(self, method: Any, payload: Any) -> None:
        with self._lock:
            self._last = asyncio.run_coroutine_threadsafe(self._send(self._last, method, payload), self.loop)

    async def _send(self, before: Any, method: Any, payload: Any) -> None:
        if before is not None:
            await asyncio.wait([asyncio.wrap_future(before)])
        end, pause = time.monotonic() + START_WAIT_S, 0.005
        while await method.remote(payload, self.key) in (GONE, False) and time.monotonic() < end:
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.1)

    def cancel(self, reason: str) -> None:
        self.actor.cancel.remote(self.key, reason)


class _Cluster:
    def __init__(self, config: Config, address: str | None) -> None:
        import ray

        from . import controller

        self.config = config
        self.started_ray = start_ray(address)
        self.controller = controller.connect(config.cluster)
        try:
            # a cluster started for this runtime ends with it: its engine is a one-shot's
            self.engine_actor, self.address = ray.get(
                self.controller.engine.remote(config.engine, long_lived=not self.started_ray))
        except ray.exceptions.RayTaskError as e:
            if self.started_ray:
                ray.shutdown()
            if isinstance(e.cause, ValueError):       # EngineMismatch, a bad model name...
                raise ValueError(str(e.cause)) from None
            raise
        # the actors' event streams are read by tasks on this loop
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pie-runtime", daemon=True)
        self.thread.start()

    def launch(self, launch: Launch) -> Process:
        launch, actor, engine = self._place(launch)
        process = Process(launch.name, _ActorControl(actor, launch.key, self.loop))
        self._run(process, launch, actor, engine)
        return process

    def _place(self, launch: Launch) -> tuple[Launch, Any, Any]:
        """The Controller's placement of `launch`: the launch under its process name, its host
        actor and its engine (an address, or a FirstPassChoice)."""
        import ray

        from . import controller

        try:
            placed = controller.ask(self.controller, "launch", launch, self.config.engine.model)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ValueError):       # the name is taken, an unknown node
                raise ValueError(str(e.cause)) from None
            if isinstance(e.cause, (EngineGone, controller.ClusterFull)):
                raise type(e.cause)(str(e.cause)) from None
            raise
        return dataclasses.replace(launch, name=placed.name), placed.actor, placed.engine

    def _run(self, process: Process, launch: Launch, actor: Any, engine: Any) -> None:
        stream = actor.run.remote(launch, engine, self.controller)
        lost = partial(self.controller.lost.remote, launch.key)
        again = None
        if launch.limits.restarts > 0:
            limits = dataclasses.replace(launch.limits, restarts=launch.limits.restarts - 1)
            again = partial(self._relaunch, process, dataclasses.replace(launch, limits=limits))
        asyncio.run_coroutine_threadsafe(_pump(stream, process, lost, again), self.loop)

    def _relaunch(self, process: Process, launch: Launch) -> None:
        """Run a restartable process again under its name, once the Controller has let go of the
        name (the ended run's actor reports it after its last event) and its engine is back."""
        deadline = time.monotonic() + RELAUNCH_WAIT_S
        while True:
            try:
                launch, actor, engine = self._place(launch)
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        process.relaunched(_ActorControl(actor, launch.key, self.loop))
        self._run(process, launch, actor, engine)

    def saved(self, owner: str | None) -> list[dict[str, Any]]:
        import ray

        return ray.get(self.engine_actor.saved.remote(owner))

    def delete_saved(self, name: str, owner: str | None) -> None:
        import ray

        try:
            ray.get(self.engine_actor.delete_saved.remote(name, owner))
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, UnknownSaved):
                raise KeyError(str(e.cause)) from None
            raise

    def stats(self) -> dict[str, Any]:
        import ray

        from . import controller

        stats = ray.get(self.engine_actor.stats.remote())
        status = controller.ask(self.controller, "status")
        model = self.config.engine.model
        return {**stats, "processes": sum(p.model == model for p in status.processes),
                "replicas": [dataclasses.asdict(r) for r in status.replicas.get(model, [])]}

    def running(self, owner: str | None) -> int:
        from . import controller

        return controller.ask(self.controller, "running", owner)

    def close(self) -> None:
        import ray

        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(5)
        except TimeoutError:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if self.started_ray:
            ray.shutdown()


async def _pump(stream: Any, process: Process, lost: Callable[[bool], Any],
                again: Callable[[], None] | None = None) -> None:
    """Hand the events of an actor's run to its Process as they arrive (lists of what arrived
    together). When the stream breaks, `lost` tells the Controller, and whether the actor died; its
    answer says whether the process declared itself restartable. `again` runs a restartable run
    once more (a pump of its own takes over) when its engine or its actor was lost under it."""
    import ray

    last = None
    try:
        async for ref in stream:
            for last in await ref:
                if isinstance(last, Failed) and last.restartable:
                    if (last := await _again(again, last)) is None:
                        return
                process.emit(last)
    except asyncio.CancelledError:    # the runtime closed: its reader must not wait forever
        process.emit(Failed("cancelled", "the runtime closed"))
        raise
    except Exception as e:            # the actor died, or its task failed outside the run
        died = isinstance(e, ray.exceptions.RayActorError)
        last = Failed("trap", f"the inferlet's actor failed: {type(e).__name__}: {e}")
        if await lost(died) and died:
            if (last := await _again(again, last)) is None:
                return
        process.emit(last)
    if not isinstance(last, (Done, Failed)):
        process.emit(Failed("trap", f"process {process.name!r} ended without a result"))


async def _again(again: Callable[[], None] | None, failed: Failed) -> Failed | None:
    """Run a restartable process again: None once it started again, else `failed`, saying why not."""
    if again is None:
        return failed
    try:
        await asyncio.to_thread(again)
        return None
    except Exception as e:
        return dataclasses.replace(failed, message=f"{failed.message} (not restarted: {type(e).__name__}: {e})")


async def _cancel_all() -> None:
    """Stop the pumps of processes still running (on the runtime's loop)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def cluster_address(address: str | None = None) -> str | None:
    """The Ray cluster to join: `address`, RAY_ADDRESS, or the one `ray start` runs on this machine;
    None when there is none. Ray's own lookup trusts the address file that `ray start` writes, which
    outlives a cluster that was killed, and then waits minutes on the dead address."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        return address
    from ray._private.utils import read_ray_address

    found = read_ray_address()
    if not found:
        return None
    host, _, port = found.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except (OSError, ValueError):
        return None                               # a stale file: that cluster is gone
    return found


def start_ray(address: str | None = None) -> bool:
    """Join the Ray cluster `cluster_address` finds, or start a local one (always, with `address`
    "local"), unless this process is connected already; True when it started or joined one here
    (the caller's `ray.shutdown`).
    A local cluster's processes die with the *thread* that starts them (Ray has the kernel kill
    them when their parent goes, and for the kernel a thread is the parent): start it from one
    that lives as long as the cluster is needed."""
    import ray

    from .controller import NAMESPACE

    if ray.is_initialized():
        return False
    found = None if address == "local" else cluster_address(address)
    # None running: a local one, for this runtime. Its workers at nice 0, as this process is: Ray
    # starts them at nice 15 by default, so the engine's actor lost the cores to pie serve's HTTP
    # process (bench/RESULTS.md, "pie serve on the cluster"). `ray start` takes RAY_worker_niceness=0.
    own = {} if found else {"include_dashboard": False, "_system_config": {"worker_niceness": 0}}
    # Ray's own logger at ERROR: its notices (e.g. that it turned token authentication on, its default)
    # are not the product's lines; with configure_logging=False they reached stderr all the same
    ray.init(address=found or "local", **own, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    return True
