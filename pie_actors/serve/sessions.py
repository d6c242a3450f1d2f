"""The processes clients launch over the WebSocket, kept between their connections (`Sessions`):
who owns each, which connection is attached to it, what it sent while none was, and when a
process nobody attaches to is ended. The rules are the protocol's (pie_actors/ws_protocol.py).

A plain class for one asyncio loop (the server's): every method runs on it. Each process's events
are read from its `Process` (the launch API) by a task of that loop and handed, numbered, to the
attached `Listener` (a connection, ws.py) or kept for the next one.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Protocol

from ..config import RunLimits
from ..process import Done, Event, Failed, Process
from ..program import Program
from ..ws_protocol import RequestError, program_hash

__all__ = ["Sessions", "Session", "Listener"]

MAX_PROGRAMS = 256          # uploads kept, all keys together (the least recently used go first)


class Listener(Protocol):
    """An attached client (a connection)."""

    def event(self, session: Session, seq: int, event: Event) -> None:
        """The process's event number `seq`."""

    def taken(self, session: Session) -> None:
        """Another client attached to the process: this one gets nothing more of it."""


@dataclass(eq=False)
class Session:
    id: str
    owner: str | None
    process: Process
    started: float = field(default_factory=time.monotonic)
    listener: Listener | None = None
    kept: deque[tuple[int, Event]] = field(default_factory=deque)   # events waiting for a client
    seq: int = 0                                                   # the next event's number
    end: Done | Failed | None = None
    overflowed: bool = False                                       # ended for sending too much detached
    expiry: asyncio.TimerHandle | None = None
    waiters: list[asyncio.Future] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        """The process as `ps` lists it."""
        state = "running" if self.end is None else "done" if isinstance(self.end, Done) else "failed"
        return {"process": self.id, "name": self.process.name, "state": state,
                "attached": self.listener is not None, "buffered": len(self.kept),
                "age_s": round(time.monotonic() - self.started, 3)}


class Sessions:
    """`idle_timeout_s`: how long a process may have no client attached before it is ended and
    forgotten. `buffer_limit`: messages it may send meanwhile; the next one ends it."""

    def __init__(self, idle_timeout_s: float, buffer_limit: int,
                 spent: Callable[[str | None, int], None] = lambda owner, tokens: None) -> None:
        """`spent(owner, tokens)`: a process ended, having cost the engine `tokens` (the quotas)."""
        self.idle_timeout_s, self.buffer_limit, self.spent = idle_timeout_s, buffer_limit, spent
        self._sessions: dict[str, Session] = {}
        self._programs: OrderedDict[tuple[str | None, str], Program] = OrderedDict()
        self._pumps: set[asyncio.Task] = set()

    # ---- programs ------------------------------------------------------------------------------

    def upload(self, owner: str | None, program: Program) -> str:
        """Keep `program` for `owner`'s launches; its hash."""
        key = (owner, program_hash(program))
        self._programs[key] = program
        self._programs.move_to_end(key)
        while len(self._programs) > MAX_PROGRAMS:
            self._programs.popitem(last=False)
        return key[1]

    async def launch(self, runtime: Any, owner: str | None, program_hash: str, input: Any, *,
                     files: dict[str, bytes], name: str | None, timeout: float | None,
                     limits: RunLimits | None = None) -> Session:
        """Launch `owner`'s uploaded program on `runtime` (through the launch API), within `limits`
        (default: the runtime's). The new session has no client attached yet."""
        program = self._programs.get((owner, program_hash))
        if program is None:
            raise RequestError("not_found", f"no program with hash {program_hash!r} was uploaded with this key: "
                                            "upload it first")
        self._programs.move_to_end((owner, program_hash))
        launch = partial(runtime.launch, program, input, name=name, files=files, timeout=timeout, owner=owner,
                         limits=limits)
        try:
            process = await asyncio.get_running_loop().run_in_executor(None, launch)
        except ValueError as e:                 # a name in use
            raise RequestError("invalid_request", str(e)) from None
        session = Session(secrets.token_urlsafe(16), owner, process)
        self._sessions[session.id] = session
        self._start_expiry(session)
        pump = asyncio.ensure_future(self._pump(session))
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)
        return session

    # ---- attaching -----------------------------------------------------------------------------

    def find(self, owner: str | None, process_id: Any) -> Session:
        """`owner`'s process `process_id`; another owner's does not exist for it."""
        session = self._sessions.get(process_id) if isinstance(process_id, str) else None
        if session is None or session.owner != owner:
            raise RequestError("not_found", f"no process {process_id!r}")
        return session

    def attach(self, session: Session, listener: Listener) -> None:
        """Hand `listener` the kept events, then the next ones (a client attached before is told
        it is not any more)."""
        if session.listener is not None and session.listener is not listener:
            session.listener.taken(session)
        session.listener = listener
        if session.expiry is not None:
            session.expiry.cancel()
            session.expiry = None
        while session.kept:
            listener.event(session, *session.kept.popleft())
        if session.end is not None:
            self._forget(session)

    def detach(self, session: Session, listener: Listener) -> None:
        """`listener` gets nothing more of the process (if it was attached to it)."""
        if session.listener is listener:
            session.listener = None
            self._start_expiry(session)

    def detach_all(self, listener: Listener) -> None:
        """A connection closed: its processes go on without a client."""
        for session in list(self._sessions.values()):
            self.detach(session, listener)

    def list(self, owner: str | None) -> list[dict[str, Any]]:
        return [s.row() for s in self._sessions.values() if s.owner == owner]

    async def wait(self, session: Session) -> Done | Failed:
        """How the process ends (its messages are not read); then it is forgotten."""
        if session.end is None:
            waiter = asyncio.get_running_loop().create_future()
            session.waiters.append(waiter)
            await waiter
        self._forget(session)
        return session.end

    # ---- events --------------------------------------------------------------------------------

    async def _pump(self, session: Session) -> None:
        async for event in session.process.aevents():
            self._event(session, event)

    def _event(self, session: Session, event: Event) -> None:
        seq, session.seq = session.seq, session.seq + 1
        if isinstance(event, (Done, Failed)):
            session.end = event
            self.spent(session.owner, event.tokens)
            for waiter in session.waiters:
                if not waiter.done():
                    waiter.set_result(event)
        if self._sessions.get(session.id) is not session:
            return                              # forgotten (idle): nobody will read it
        if session.listener is not None:
            session.listener.event(session, seq, event)
            if session.end is not None:
                self._forget(session)
            return
        session.kept.append((seq, event))
        if session.end is None and len(session.kept) > self.buffer_limit and not session.overflowed:
            session.overflowed = True
            session.process.kill(f"the process sent more than {self.buffer_limit} messages while no client was "
                                 "attached (serve.detached_buffer): the server ended it")

    # ---- expiry --------------------------------------------------------------------------------

    def _start_expiry(self, session: Session) -> None:
        session.expiry = asyncio.get_running_loop().call_later(self.idle_timeout_s, self._expire, session)

    def _expire(self, session: Session) -> None:
        """No client for idle_timeout_s: end the process (its pages return) and forget it."""
        session.expiry = None
        if session.end is None:
            session.process.kill(f"no client was attached for {self.idle_timeout_s:g} s (serve.idle_timeout_s)")
        self._forget(session)

    def _forget(self, session: Session) -> None:
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
        if session.expiry is not None:
            session.expiry.cancel()
            session.expiry = None
