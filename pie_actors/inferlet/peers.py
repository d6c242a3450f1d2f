"""How a run reaches the other processes of its owner: messages (`session.send_to`) and children
(`inferlet.runtime.spawn`).

A `Peers` is handed to each run of a named process by its runtime: `LocalPeers` (runtime.py,
everything in one process) or `ClusterPeers` here (a run in an InferletActor). Both give the same
semantics:

* A message goes straight into the peer's mailbox: on a cluster, the sender asks the Controller
  once for the peer's actor and then calls that actor's `deliver` itself (no central hop per
  message). Names are per owner: another owner's process is not found.
* A mailbox holds `limits.mailbox_size` messages; a sender finding it full retries until
  `limits.send_timeout_s` (and the run's deadline), then fails. `send_within` is that wait.
* Order is kept per sender -> receiver: `session.send_to` returns only once the message is in the
  peer's mailbox, so one sender's messages arrive in the order sent.
* A message to a process that is not running fails at once (`UnknownProcess`); when a process of
  that name ended lately, the error says how (`Endings`).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..config import EngineConfig
from .host import HostOpError

if TYPE_CHECKING:
    from ..launch import Launch, ProcessKey
    from ..process import Process

__all__ = ["Peers", "ClusterPeers", "UnknownProcess", "Endings", "DELIVERED", "FULL", "GONE", "send_within"]

DELIVERED, FULL, GONE = "delivered", "full", "gone"     # what one delivery attempt found
LOOKUP_WAIT_S = 30.0      # the longest a sender waits for the Controller's answer
ATTEMPT_S = 1.0           # the least one delivery attempt is given: a round trip to the peer's actor


class UnknownProcess(HostOpError):
    """No running process of the sender's owner has that name."""


class Endings:
    """How the processes that ended lately ended, by (owner, name), so that a message for one that
    is gone says so and how (a crash, a deadline), not only that no such process runs. The oldest
    are forgotten past KEPT; a runtime keeps one, under its own lock."""

    KEPT = 256

    def __init__(self) -> None:
        self._how: OrderedDict[tuple[str | None, str], str] = OrderedDict()

    def note(self, key: tuple[str | None, str], how: str) -> None:
        """Process `key` ended: `how` (see `ending`)."""
        self._how.pop(key, None)
        self._how[key] = how
        while len(self._how) > self.KEPT:
            self._how.popitem(last=False)

    def not_running(self, key: tuple[str | None, str], running: list[str]) -> str:
        """The error message for process `key`, which does not run; `running`: the owner's names."""
        how = self._how.get(key)
        return (f"no running inferlet named {key[1]!r}{f' (it {how})' if how else ''} "
                f"(running: {', '.join(sorted(running)) or 'none'})")


def ending(event: Any) -> str:
    """How a run's last event says it ended, in a few words (for `Endings.note`)."""
    from ..process import Failed

    if not isinstance(event, Failed):
        return "ended with a result"
    message = event.message if len(event.message) <= 200 else event.message[:200] + "..."
    return f"failed, {event.kind}: {message}"


class Peers(Protocol):
    """The side of a runtime that one run of process `sender` of an owner uses."""

    sender: str

    def deliver(self, name: str, message: Any, timeout: float) -> bool:
        """One attempt to put `message` into process `name`'s mailbox: False when it is full.
        Raises UnknownProcess when no such process runs; waits at most `timeout` seconds."""
        ...

    def launch(self, launch: Launch, model: str | None) -> Process:
        """Start `launch`, a process of the same owner, through the launch API (`Runtime.launch`), on
        the engine of `model` (None: the sender's)."""
        ...

    def running(self) -> int:
        """How many processes of the owner run now (this one included)."""
        ...

    def declare_restartable(self) -> None:
        """The sender may run again from the start if what runs it is lost (runtime.declare_restartable)."""
        ...


def send_within(peers: Peers, name: str, message: Any, wait_s: float) -> None:
    """Deliver `message` to `name`, waiting while its mailbox is full, `wait_s` seconds at most."""
    end = time.monotonic() + wait_s
    pause = 0.001
    while True:
        # An attempt only asks (the peer answers at once, full or not), so even the last one gets a
        # whole round trip: near the end a sub-ms allowance would report a slow answer, not a full box.
        if peers.deliver(name, message, max(ATTEMPT_S, end - time.monotonic())):
            return
        if time.monotonic() + pause > end:
            raise HostOpError(f"session.send_to: the mailbox of {name!r} stayed full for {wait_s:.3g} s "
                              "(it receives more slowly than it is sent to; limits.mailbox_size)")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


class ClusterPeers:
    """`Peers` of a run in an inferlet host actor: the process (owner, sender) of the Controller's
    table. `local(key)` is the Run of process `key` when it runs in the same host actor: a message
    to it goes straight into its mailbox, with no Ray call."""

    def __init__(self, controller: Any, owner: str | None, sender: str,
                 local: Callable[[ProcessKey], Any] | None = None) -> None:
        self.controller, self.owner, self.sender, self.local = controller, owner, sender, local
        self._actors: dict[str, Any] = {}        # peer name -> its actor (looked up once)

    def _lookup(self, name: str, timeout: float) -> Any:
        import ray

        try:
            return ray.get(self.controller.lookup.remote(self.owner, name), timeout=min(timeout, LOOKUP_WAIT_S))
        except ray.exceptions.RayTaskError as e:
            raise UnknownProcess(str(e.cause)) from None
        except ray.exceptions.GetTimeoutError:
            raise HostOpError(f"session.send_to: the Controller did not answer within {timeout:.3g} s") from None

    def deliver(self, name: str, message: Any, timeout: float) -> bool:
        import ray

        key = (self.owner, name)
        end, pause = time.monotonic() + timeout, 0.002
        while True:
            run = self.local(key) if self.local is not None else None
            if run is not None:                  # a neighbour in this actor
                return run.deliver(message, self.sender)
            actor = self._actors.get(name) or self._lookup(name, max(0.001, end - time.monotonic()))
            try:
                # A blocking call: the actor runs `deliver` among its other calls, and Ray keeps the
                # submission order of one submitter's tasks only for synchronous single-threaded
                # actors, not for threaded or async ones ("Actor Task Execution Order",
                # docs.ray.io/en/latest/ray-core/actors/task-orders.html). So the next message of
                # this sender goes once this one is in the mailbox.
                found = ray.get(actor.deliver.remote(message, key, self.sender),
                                timeout=max(0.001, end - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise HostOpError(f"session.send_to: process {name!r} did not take the message within "
                                  f"{timeout:.3g} s") from None
            except ray.exceptions.RayActorError:
                found = GONE
            if found != GONE:
                self._actors[name] = actor
                return found == DELIVERED
            # Its actor runs no such process: it ended (the Controller hears of it at once, and then
            # the lookup fails), or its run has not begun (launched, the actor not yet started it).
            self._actors.pop(name, None)
            if time.monotonic() + pause > end:
                raise HostOpError(f"session.send_to: process {name!r} did not start within {timeout:.3g} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def launch(self, launch: Launch, model: str | None) -> Process:
        import ray

        try:   # the engine settings of `model` (None: this process's model), as the cluster runs it
            engine = ray.get(self.controller.engine_config.remote(model, (self.owner, self.sender)),
                             timeout=LOOKUP_WAIT_S)
        except ray.exceptions.RayTaskError as e:
            raise HostOpError(str(e.cause)) from None
        return _cluster_runtime(engine).start(launch)

    def running(self) -> int:
        import ray

        return ray.get(self.controller.running.remote(self.owner), timeout=LOOKUP_WAIT_S)

    def declare_restartable(self) -> None:
        self.controller.declare_restartable.remote((self.owner, self.sender))


_runtimes: dict[EngineConfig, Any] = {}      # an engine's settings -> the launch API on its cluster


def _cluster_runtime(engine: EngineConfig) -> Any:
    """The launch API on this actor's cluster (`Runtime.connect` finds Ray initialized) for
    programs on the engine of `engine`'s model, which runs already."""
    from ..runtime import Runtime

    runtime = _runtimes.get(engine)
    if runtime is None:
        runtime = _runtimes[engine] = Runtime.connect(**{f.name: getattr(engine, f.name) for f in fields(engine)})
    return runtime
