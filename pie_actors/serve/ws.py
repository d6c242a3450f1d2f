"""The WebSocket of pie-client at /v1/ws: one `Connection` per client, speaking the protocol of
pie_actors/ws_protocol.py (its docstring) over the processes in `Serving.sessions`.

A connection reads frames one at a time and answers each; everything it writes (answers, and
the events of the processes it is attached to) goes through one queue, in order, so that an
answer such as "detached" comes after every event sent before it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Collection

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..process import Event
from ..ws_protocol import RequestError, binary, decode, encode, event_frame, program_of
from .auth import check_key, owner_of, presented_key
from .errors import ApiError
from .routes import Serving
from .sessions import Session, Sessions

__all__ = ["endpoint", "Connection"]

log = logging.getLogger("pie.serve")

MISSING = object()


def field(frame: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = MISSING) -> Any:
    """`frame[name]`, which must be of `kind`; `default` when it is absent or null (without a
    default it is required)."""
    value = frame.get(name)
    if value is None:
        if default is MISSING:
            raise RequestError("bad_frame", f"a {frame['type']!r} frame needs {name!r}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:   # True is no number here
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError("bad_frame", f"{frame['type']!r}: {name!r} must be {names}, not {type(value).__name__}")
    return value


class Connection:
    """One client's connection. `keys`: the server's API keys (none: single-user)."""

    def __init__(self, websocket: WebSocket, serving: Serving, keys: Collection[str]) -> None:
        self.websocket, self.serving, self.keys = websocket, serving, keys
        self.sessions: Sessions = serving.sessions
        self.owner: str | None = None
        self.authenticated = not keys
        self.binary = False                      # the encoding of the client's latest frame
        self.outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.waits: set[asyncio.Task] = set()     # "wait" requests not answered yet
        self.requests: dict[str, Callable] = {
            "auth": self.auth, "upload": self.upload, "launch": self.launch, "attach": self.attach,
            "detach": self.detach, "send": self.send, "send_file": self.send_file, "kill": self.kill,
            "ps": self.ps, "wait": self.wait, "saved": self.saved, "delete_saved": self.delete_saved}

    async def serve(self) -> None:
        await self.websocket.accept()
        writer = asyncio.ensure_future(self._write())
        try:
            key = presented_key(self.websocket)
            if key is not None:
                self._login(key)
        except RequestError as e:
            self.put({"type": "error", "code": e.code, "message": e.message})
        else:
            await self._read()
        finally:
            self.sessions.detach_all(self)
            for task in self.waits:
                task.cancel()
            self.outbox.put_nowait(None)
            await writer

    # ---- reading and writing -------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text") if message.get("text") is not None else message.get("bytes")
            self.binary = isinstance(data, bytes)
            request_id = None
            try:
                frame = decode(data)
                request_id = frame.get("id")
                kind = frame.get("type")
                if kind not in self.requests:
                    raise RequestError("bad_frame", f"unknown frame type {kind!r}; requests: {', '.join(self.requests)}")
                if not self.authenticated and kind != "auth":
                    raise RequestError("missing_key", "this server needs an API key: send it at the handshake "
                                                      '(Authorization: Bearer KEY) or as {"type": "auth", "key": KEY}')
                reply = await self.requests[kind](frame)
            except RequestError as e:
                reply = {"type": "error", "code": e.code, "message": e.message}
            except Exception as e:                # a bug: answered, and the connection goes on
                log.exception("WebSocket request failed")
                reply = {"type": "error", "code": "server_error", "message": f"{type(e).__name__}: {e}"}
            if reply is not None:
                self.put(reply, request_id)
                if reply.get("code") == "invalid_key":
                    return

    def put(self, frame: dict[str, Any], request_id: Any = None) -> None:
        self.outbox.put_nowait(frame if request_id is None else {**frame, "id": request_id})

    async def _write(self) -> None:
        while (frame := await self.outbox.get()) is not None:
            try:
                if self.binary:
                    await self.websocket.send_bytes(encode(frame, True))
                else:
                    await self.websocket.send_text(encode(frame, False))
            except (WebSocketDisconnect, RuntimeError, OSError):
                return                            # the client is gone: its processes were detached
            if frame.get("code") == "invalid_key":
                await self.websocket.close(1008)
                return

    # ---- Listener (sessions.py) ----------------------------------------------------------------

    def event(self, session: Session, seq: int, event: Event) -> None:
        self.put(event_frame(session.id, seq, event))

    def taken(self, session: Session) -> None:
        self.put({"type": "detached", "process": session.id, "reason": "another connection attached it"})

    # ---- requests ------------------------------------------------------------------------------

    def _login(self, key: str) -> None:
        """Take `key` as this connection's (RequestError "invalid_key": it closes)."""
        if self.keys:
            try:
                check_key(key, self.keys)
            except ApiError as e:
                raise RequestError(e.kind, e.message) from None
            self.owner = owner_of(key)
        self.authenticated = True

    async def auth(self, frame: dict[str, Any]) -> dict[str, Any]:
        key = field(frame, "key", str)
        if self.authenticated and self.keys:
            raise RequestError("invalid_request", "this connection has its key already")
        self._login(key)
        return {"type": "ok"}

    async def upload(self, frame: dict[str, Any]) -> dict[str, Any]:
        program = program_of(field(frame, "program", dict))
        return {"type": "uploaded", "hash": self.sessions.upload(self.owner, program)}

    async def launch(self, frame: dict[str, Any]) -> None:
        program_hash, input = field(frame, "hash", str), field(frame, "input", dict, {})
        name, detach = field(frame, "name", str, None), field(frame, "detach", bool, False)
        files = {key: binary(data, f"files[{key!r}]") for key, data in field(frame, "files", dict, {}).items()}
        timeout = field(frame, "timeout", (int, float), None)
        if timeout is not None and not timeout > 0:
            raise RequestError("bad_frame", f"'launch': 'timeout' must be positive, not {timeout!r}")
        runtime, quotas = self._runtime(), self.serving.quotas
        try:
            with quotas.launching(self.owner):
                session = await self.sessions.launch(runtime, self.owner, program_hash, input, files=files,
                                                     name=name, timeout=timeout,
                                                     limits=quotas.limits(self.owner, runtime.config.limits))
        except ApiError as e:                     # over one of the key's quotas
            raise RequestError(e.kind, e.message) from None
        self.put({"type": "launched", "process": session.id, "name": session.process.name}, frame.get("id"))
        if not detach:
            self.sessions.attach(session, self)

    async def attach(self, frame: dict[str, Any]) -> None:
        session = self._session(frame)
        self.put({"type": "attached", "process": session.id, "name": session.process.name}, frame.get("id"))
        self.sessions.attach(session, self)

    async def detach(self, frame: dict[str, Any]) -> dict[str, Any]:
        session = self._session(frame)
        self.sessions.detach(session, self)
        return {"type": "detached", "process": session.id}

    async def send(self, frame: dict[str, Any]) -> dict[str, Any]:
        session = self._running(frame)
        if "message" not in frame:
            raise RequestError("bad_frame", "a 'send' frame needs 'message'")
        session.process.send(frame["message"])
        return {"type": "ok"}

    async def send_file(self, frame: dict[str, Any]) -> dict[str, Any]:
        session = self._running(frame)
        session.process.send_file(binary(field(frame, "data", (bytes, str)), "data"))
        return {"type": "ok"}

    async def kill(self, frame: dict[str, Any]) -> dict[str, Any]:
        self._session(frame).process.kill()
        return {"type": "ok"}

    async def ps(self, frame: dict[str, Any]) -> dict[str, Any]:
        return {"type": "processes", "processes": self.sessions.list(self.owner)}

    async def saved(self, frame: dict[str, Any]) -> dict[str, Any]:
        """The working sets this key's processes saved (`ws.save`)."""
        return {"type": "saved", "saved": await asyncio.to_thread(self._runtime().saved, self.owner)}

    async def delete_saved(self, frame: dict[str, Any]) -> dict[str, Any]:
        name = field(frame, "name", str)
        try:
            await asyncio.to_thread(self._runtime().delete_saved, name, self.owner)
        except KeyError:
            raise RequestError("not_found", f"no saved working set named {name!r}") from None
        return {"type": "ok"}

    def _runtime(self) -> Any:
        if self.serving.endpoints is None:
            raise RequestError("unavailable", self.serving.loading_error or "the engine is still loading")
        return self.serving.runtime

    async def wait(self, frame: dict[str, Any]) -> None:
        """Answered when the process ends; the connection goes on reading meanwhile."""
        session, request_id = self._session(frame), frame.get("id")

        async def answer() -> None:
            end = await self.sessions.wait(session)
            frame = event_frame(session.id, 0, end)
            del frame["seq"]
            self.put(frame, request_id)
        task = asyncio.ensure_future(answer())
        self.waits.add(task)
        task.add_done_callback(self.waits.discard)

    def _session(self, frame: dict[str, Any]) -> Session:
        return self.sessions.find(self.owner, field(frame, "process", str))

    def _running(self, frame: dict[str, Any]) -> Session:
        session = self._session(frame)
        if session.end is not None:
            raise RequestError("invalid_request", f"process {session.id!r} has ended")
        return session


def endpoint(serving: Serving, keys: Collection[str]) -> Callable[[WebSocket], Any]:
    """The WebSocket route's handler."""
    async def handle(websocket: WebSocket) -> None:
        await Connection(websocket, serving, tuple(keys)).serve()
    return handle
