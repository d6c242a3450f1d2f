"""InferletActor: a Ray actor that runs inferlets in its WebAssembly sandbox, one at a time.

The actor loads the runner component once when it starts; each run gets a fresh Store. Its `run`
method is a Ray streaming generator of the run's events (pie_actors.process): Send and File while
the inferlet runs, then Done or Failed, so a client reads it with `async for ref in
actor.run.remote(...)`. Forward passes go straight from the actor to the engine over its socket
(inferlet/run.py), never through Ray. torch is never imported here.

While a run streams, `deliver`, `deliver_file` and `cancel` are served concurrently (the actor has a
few threads); each names the process it is meant for (its (owner, name) key), so a late call never
reaches the actor's next run. A run started by the Controller hands the actor back when it ends.
Other processes' `session.send_to` call `deliver` directly (peers.py: ClusterPeers).
"""
from __future__ import annotations

import queue
import threading
from functools import partial
from typing import Any, Iterator

from ..config import RunLimits
from ..gpu.engine.wire import EngineAddress
from ..placement import FirstPassChoice
from ..process import Done, Event, Failed
from ..program import Program
from .peers import DELIVERED, FULL, GONE, ClusterPeers, ending
from .run import Run, sandbox_for
from .run_state import EngineChoice


class InferletActor:
    """Plain class; the Ray actor is `inferlet_actor()` (see there)."""

    def __init__(self) -> None:
        sandbox_for(Program())             # the runner component, loaded before the first launch
        self._lock = threading.Lock()
        self._process: Any = None          # the (owner, name) of the run in progress
        self._run: Run | None = None
        self._model: str | None = None     # its model, when its first pass chooses the engine

    def ready(self) -> bool:
        """For warm pools: returns once the sandbox is loaded."""
        return True

    def whereabouts(self) -> tuple[str, Any, tuple[str, int] | None, str | None]:
        """(its Ray node, the (owner, name) of the run in progress, the (host, port) of its engine
        (None: no run, or its first pass has not chosen one yet) and the model of a run whose first
        pass chooses its engine): what the Controller asks of its actors (a replica on the same
        node; its processes after it restarts)."""
        import ray
        with self._lock:
            engine = None if self._run is None else self._run.engine
            return ray.get_runtime_context().get_node_id(), self._process, engine, self._model

    def run(self, program: Program, input: Any, engine_address: EngineAddress | FirstPassChoice, limits: RunLimits, *,
            files: dict[str, bytes] | None = None, process: Any = None,
            controller: Any = None) -> Iterator[Event]:
        """The events of one run of `program`, ending with its Done or Failed (the actor stays
        usable). With a `controller`, the run is the process `process` ((owner, name)):
        `session.send_to` reaches the owner's other processes, the Controller chooses the engine
        at the first pass when the launch left it to that (a FirstPassChoice), and the actor hands
        itself back to the Controller at the end."""
        events: queue.Queue[Event] = queue.Queue()
        peers = None if controller is None else ClusterPeers(controller, *process)
        owner = None if process is None else process[0]
        model = engine_address.model if isinstance(engine_address, FirstPassChoice) else None
        if model is not None:
            engine_address = EngineChoice(engine_address.info, partial(_choose, controller, model, owner))
        run = Run(program, input, engine_address, limits, events.put, files=files, peers=peers, owner=owner)
        with self._lock:
            self._process, self._run, self._model = process, run, model
        event = None
        try:
            run.start()
            while True:
                event = events.get()
                yield event
                if isinstance(event, (Done, Failed)):
                    return
        finally:
            with self._lock:
                self._process = self._run = self._model = None
            if controller is not None:
                ended = isinstance(event, (Done, Failed))
                controller.finished.remote(process, ending(event) if ended else None)

    def _current(self, process: Any) -> Run | None:
        with self._lock:
            return self._run if process == self._process else None

    def deliver(self, message: Any, process: Any = None, sender: str | None = None) -> str:
        """A message for the running inferlet's `session.receive`, from its client or from process
        `sender` of its owner: DELIVERED, FULL (its mailbox is: not taken), or GONE (no run of
        `process` is in progress here: it ended, the message is dropped)."""
        run = self._current(process)
        if run is None:
            return GONE
        return DELIVERED if run.deliver(message, sender) else FULL

    def deliver_file(self, data: bytes, process: Any = None) -> bool:
        """Data for the running inferlet's `session.receive_file` (False: no such run here)."""
        run = self._current(process)
        if run is not None:
            run.deliver_file(data)
        return run is not None

    def cancel(self, process: Any = None, reason: str = "cancelled by the client") -> bool:
        """Stop the run of `process` at its next host call; its pages return. False: none runs."""
        run = self._current(process)
        if run is not None:
            run.cancel(reason)
        return run is not None


def _choose(controller: Any, model: str, owner: str | None, prefix: list[int] | None, timeout: float) -> EngineAddress:
    """The Controller's choice of `model`'s replica for a first pass on this node starting with `prefix`."""
    import ray
    node = ray.get_runtime_context().get_node_id()
    return ray.get(controller.choose.remote(model, node, prefix, owner), timeout=timeout)


def inferlet_actor(**options: Any):
    """The Ray actor class. num_cpus=0: an inferlet mostly waits on the engine, and whole-CPU actors
    would cap a 2-core node at two inferlets. A few threads: `deliver` and `cancel` run while
    `run` streams."""
    import ray
    return ray.remote(num_cpus=0, max_concurrency=4, **options)(InferletActor)
