"""A running inferlet as its launcher sees it: a `Process` and the typed events it streams.

An inferlet's run produces, in order, any number of `Send` (its `session.send` text) and `File`
(its `session.send_file` data) events, then exactly one `Done` (main's output) or `Failed` (why it
ended). Events come from any thread (the run's host, or the task that reads a Ray actor's stream)
and are read, in order, with the sync iterator `events()` or the async iterator `aevents()`;
`result()` reads past the rest and returns the output. A process is read by one reader.

Imported by inferlet actors: nothing here imports torch or Ray.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Protocol, Union

from .inferlet.host import InferletError

__all__ = ["Send", "File", "Done", "Failed", "Event", "Process", "InferletError"]


@dataclass(frozen=True)
class Send:
    """Text the inferlet streamed (`session.send`; a JSON value arrives as its JSON text)."""

    text: str


@dataclass(frozen=True)
class File:
    """Binary data the inferlet sent (`session.send_file`)."""

    data: bytes


@dataclass(frozen=True)
class Done:
    """The run returned: `output` is main's result. `tokens`: the input rows the engine ran for
    it, prompts and generated tokens (prefix-cache hits not among them), its children's that
    ended before it included."""

    output: Any
    tokens: int = field(default=0, compare=False)     # what it cost, not what it gave


@dataclass(frozen=True)
class Failed:
    """The run ended without a result. `kind` is one of InferletError.KINDS. `restartable`: the
    program declared itself restartable and its engine was lost under it, so its launcher may run it
    again from the start (Runtime.connect does, up to `limits.restarts` times)."""

    kind: str
    message: str
    traceback: str = ""
    restartable: bool = False
    tokens: int = field(default=0, compare=False)     # as Done.tokens, up to the failure

    def error(self) -> InferletError:
        return InferletError(self.kind, self.message, self.traceback)

    @classmethod
    def of(cls, error: InferletError, restartable: bool = False, tokens: int = 0) -> Failed:
        return cls(error.kind, error.message, error.guest_traceback, restartable, tokens)


Event = Union[Send, File, Done, Failed]


class EventStream:
    """Events put from any thread, taken in order by a sync or an async reader."""

    def __init__(self) -> None:
        self._items: deque[Event] = deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def put(self, event: Event) -> None:
        with self._cond:
            self._items.append(event)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:
                pass          # that reader's loop is closed: it is not waiting any more

    def get(self, timeout: float | None = None) -> Event:
        """The next event; TimeoutError when none arrives within `timeout` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no event within {timeout} s")
                self._cond.wait(left)
            return self._items.popleft()

    async def aget(self) -> Event:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                future = loop.create_future()
                self._waiters.append((loop, future))
            await future


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Control(Protocol):
    """What a runtime does for a process: the backend's side of `Process` (inferlet.run.Run in
    this process, its actor's methods on a cluster)."""

    def deliver(self, message: Any) -> None: ...

    def deliver_file(self, data: bytes) -> None: ...

    def cancel(self, reason: str) -> None: ...


class Process:
    """A launched inferlet. `name` reaches it from other inferlets' `session.send_to`."""

    def __init__(self, name: str, control: Control) -> None:
        self.name = name
        self._control = control
        self._stream = EventStream()
        self._end: Done | Failed | None = None   # the last event, once read

    def __repr__(self) -> str:
        state = "running" if self._end is None else type(self._end).__name__.lower()
        return f"<Process {self.name!r} {state}>"

    def emit(self, event: Event) -> None:
        """The backend's side: the run produced `event` (any thread)."""
        self._stream.put(event)

    def relaunched(self, control: Control) -> None:
        """The backend's side: the run starts again (a restartable one, its engine lost), controlled
        by `control`; its events follow those of the run before."""
        self._control = control

    @property
    def ended(self) -> bool:
        """Whether the reader has seen the run's Done or Failed."""
        return self._end is not None

    @property
    def tokens(self) -> int:
        """What the run cost the engine (Done.tokens), once the reader has seen its end; else 0."""
        return 0 if self._end is None else self._end.tokens

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The run's events as they arrive, ending with its Done or Failed (nothing after that).
        `timeout`: the most seconds to wait for any one event (TimeoutError)."""
        while self._end is None:
            event = self._stream.get(timeout)
            if isinstance(event, (Done, Failed)):
                self._end = event
            yield event

    async def aevents(self) -> AsyncIterator[Event]:
        """`events()` for asyncio code: awaits each event without blocking the loop."""
        while self._end is None:
            event = await self._stream.aget()
            if isinstance(event, (Done, Failed)):
                self._end = event
            yield event

    def result(self, timeout: float | None = None) -> Any:
        """Main's output, once the run ends (events not read yet are skipped). Raises InferletError
        when it failed, TimeoutError when it does not end within `timeout` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._end is None:
            event = self._stream.get(None if end is None else max(0.0, end - time.monotonic()))
            if isinstance(event, (Done, Failed)):
                self._end = event
        if isinstance(self._end, Failed):
            raise self._end.error()
        return self._end.output

    async def aresult(self) -> Any:
        """`result()` for asyncio code."""
        async for _ in self.aevents():
            pass
        return self.result()

    def send(self, message: Any) -> None:
        """A message (text or a JSON value) for the inferlet's `session.receive()`."""
        self._control.deliver(message)

    def send_file(self, data: bytes) -> None:
        """Binary data for the inferlet's `session.receive_file()`."""
        self._control.deliver_file(bytes(data))

    def kill(self, reason: str | None = None) -> None:
        """Stop the run at its next host call: it ends Failed("cancelled", reason), its KV pages
        return. `reason` defaults to "killed by request (process NAME)"."""
        self._control.cancel(reason or f"killed by request (process {self.name!r})")
