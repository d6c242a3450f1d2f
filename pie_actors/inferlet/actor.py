"""InferletActor: a Ray actor that hosts many inferlet runs at once, each in its own sandbox instance.

The actor loads the runner component once when it starts; each run gets a fresh Store (a pooled
instance slot), its own mailbox, limits, deadline and identity (its launch's (owner, name)), and a
thread of its own, as runs do in one process without Ray (`Runtime.local`): a Python process and
a Ray worker cost ~90 MB, a run's sandbox a few. `run` is a Ray streaming generator of the run's
events (pie_actors.process), in lists of what arrived together (one item per token would cost a
Ray report each under load): Send and File while the inferlet runs, then Done or Failed last. A
client reads it with `async for ref in actor.run.remote(...)`. Forward passes go straight from
the actor to the engine over its socket (inferlet/run.py), never through Ray. torch is never
imported here.

`deliver`, `deliver_file` and `cancel` name the process they mean (its (owner, name) key), so a
late call never reaches another run. Other processes' `session.send_to` call `deliver` directly
(peers.py: ClusterPeers), and a neighbour in the same actor puts the message into the mailbox with
no Ray call. The actor is async: its runs stream on one event loop, however many there are.
"""
from __future__ import annotations

import asyncio
import threading
from functools import partial
from typing import Any, AsyncIterator

from .. import cpu_cores
from ..gpu.engine.wire import EngineAddress
from ..launch import Launch, ProcessKey
from ..placement import FirstPassChoice
from ..process import Done, Event, Failed
from ..program import Program
from .peers import DELIVERED, FULL, GONE, ClusterPeers, ending
from .run import Run, sandbox_for
from .run_state import EngineChoice

Hosted = tuple[ProcessKey, "tuple[str, int] | None", "str | None"]   # what `whereabouts` says of a run
REPORT_TIMEOUT_S = 10.0          # the longest a run's end waits on the Controller's bookkeeping


class InferletActor:
    """Plain class; the Ray actor is `inferlet_actor()` (see there)."""

    def __init__(self) -> None:
        cpu_cores.keep_off()               # onto every core but a CPU engine's (its raylet's mask may be narrower)
        sandbox_for(Program())             # the runner component, loaded before the first launch
        self._lock = threading.Lock()
        self._runs: dict[ProcessKey, tuple[Run, str | None]] = {}   # key -> its Run, and its model when
                                                                     # its first pass chooses the engine

    def ready(self) -> bool:
        """Returns once the sandbox is loaded (a new actor's first call waits for its start)."""
        return True

    def whereabouts(self) -> tuple[str, list[Hosted]]:
        """(its Ray node, and for each run in progress: its (owner, name), the (host, port) of its
        engine (None: its first pass has not chosen one yet) and its model when the first pass
        chooses its engine): what the Controller asks of its actors after it restarts."""
        import ray
        with self._lock:
            runs = [(key, run.engine, model) for key, (run, model) in self._runs.items()]
        return ray.get_runtime_context().get_node_id(), runs

    def find(self, key: ProcessKey) -> Run | None:
        """The Run of process `key` if it runs here."""
        with self._lock:
            hosted = self._runs.get(key)
        return None if hosted is None else hosted[0]

    async def run(self, launch: Launch, engine_address: EngineAddress | FirstPassChoice,
                  controller: Any = None) -> AsyncIterator[list[Event]]:
        """The events of one run of `launch`, ending with its Done or Failed. With a `controller`,
        the run is process `launch.key` of the Controller's table: `session.send_to` reaches the
        owner's other processes, the Controller chooses the engine at the first pass when the launch
        left it to that (a FirstPassChoice), and the actor tells the Controller when the run ends."""
        cpu_cores.keep_off()               # a CPU engine that started since may have taken cores
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        key = launch.key
        peers = None if controller is None else ClusterPeers(controller, launch.owner, launch.name, self.find)
        model = engine_address.model if isinstance(engine_address, FirstPassChoice) else None
        if model is not None:
            engine_address = EngineChoice(engine_address.info, partial(_choose, controller, model, launch.owner))
        run = Run(launch, engine_address, partial(loop.call_soon_threadsafe, events.put_nowait), peers)
        with self._lock:
            self._runs[key] = (run, model)
        last: Event | None = None
        reported = controller is None
        try:
            run.start()
            while not isinstance(last, (Done, Failed)):
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                last = batch[-1]
                if isinstance(last, (Done, Failed)) and not reported:
                    # The Controller forgets the name before the reader sees the end: a relaunch
                    # under the same name, or a status read, right after the result finds it gone.
                    reported = True
                    try:
                        await asyncio.wait_for(controller.finished.remote(key, ending(last)), REPORT_TIMEOUT_S)
                    except Exception:     # a restarting Controller finds the run gone (whereabouts)
                        pass
                yield batch
        finally:
            with self._lock:
                if self._runs.get(key, (None,))[0] is run:
                    del self._runs[key]
            if not isinstance(last, (Done, Failed)):   # its reader went away: it must not go on unread
                run.cancel("its launcher stopped reading it")
            if not reported:
                controller.finished.remote(key, None)

    def deliver(self, message: Any, process: ProcessKey, sender: str | None = None) -> str:
        """A message for the `session.receive` of process `process`, from its client or from process
        `sender` of its owner: DELIVERED, FULL (its mailbox is: not taken), or GONE (no run of
        `process` is in progress here: it ended, the message is dropped)."""
        run = self.find(process)
        if run is None:
            return GONE
        return DELIVERED if run.deliver(message, sender) else FULL

    def deliver_file(self, data: bytes, process: ProcessKey) -> bool:
        """Data for the `session.receive_file` of process `process` (False: no such run here)."""
        run = self.find(process)
        if run is not None:
            run.deliver_file(data)
        return run is not None

    def cancel(self, process: ProcessKey, reason: str = "cancelled by the client") -> bool:
        """Stop the run of `process` at its next host call; its pages return. False: none runs."""
        run = self.find(process)
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
    would cap a 2-core node at two. Async: every run streams on the actor's event loop, and its
    control calls (`deliver`, `cancel`) run between their events."""
    import ray
    return ray.remote(num_cpus=0, **options)(InferletActor)
