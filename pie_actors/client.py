"""`Client`: programs on a running `pie serve`, over its WebSocket (pie_actors/ws_protocol.py), in the
launch API's shape.

    with Client("http://127.0.0.1:8080", api_key=KEY) as client:
        process = client.submit("examples/quickstart/main.py", {"question": "What is 2 + 2?"})
        for event in process.events():        # Send(text) ... then Done(output) or Failed(...)
            ...
        process.send("next turn")             # and send_file, kill, result, as a launched Process
        process.detach()                      # it runs on; Client(...).attach(process.id) follows it again

One connection per Client, read by a thread of its own: answers go to the request that waits for
them, events to their process. Programs are sent once: the server keeps them by content hash.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .process import EventStream, Failed, Process
from .program import Program
from .ws_protocol import PATH, RequestError, decode, encode, frame_event, program_hash, program_payload

__all__ = ["Client", "RemoteProcess", "Detached", "RequestError"]

EVENTS = ("text", "file", "done", "failed")


class Detached(ConnectionError):
    """This client follows the process no more: it detached, another client attached it, or the
    connection closed. The process may still run: `Client.attach(id)` follows it again."""


class _Stream(EventStream):
    """A process's events; a Detached put in it is raised to the reader (and stays there)."""

    def get(self, timeout: float | None = None) -> Any:
        event = super().get(timeout)
        if isinstance(event, Detached):
            self.put(event)
            raise event
        return event


class _Remote:
    """A remote process's control (process.Control): the client's requests for it."""

    def __init__(self, client: Client, process_id: str) -> None:
        self.client, self.id = client, process_id

    def deliver(self, message: Any) -> None:
        self.client.send(self.id, message)

    def deliver_file(self, data: bytes) -> None:
        self.client.send_file(self.id, data)

    def cancel(self, reason: str) -> None:        # the server says why: killed by request
        self.client.kill(self.id)


class RemoteProcess(Process):
    """A process on the server, as its client follows it: a `Process` (events, result, send,
    send_file, kill) with the server's `id` for it. Reading its events raises Detached once the
    client does not follow it any more."""

    def __init__(self, client: Client, process_id: str, name: str) -> None:
        super().__init__(name, _Remote(client, process_id))
        self._stream = _Stream()
        self.id, self._client = process_id, client

    def __repr__(self) -> str:
        return f"<RemoteProcess {self.id} {self.name!r}>"

    def detach(self) -> None:
        """Stop following the process; it runs on, and keeps what it sends for the next attach."""
        self._client._request({"type": "detach", "process": self.id})
        self._client._unfollow(self.id, "detached")


def ws_url(url: str) -> str:
    """The WebSocket URL of a server given as http(s)://HOST:PORT (or already ws(s)://...)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") or PATH, parts.query, ""))


class Client:
    """A connection to the pie serve at `url` (http://HOST:PORT) under `api_key` (None: a server
    without keys). `timeout`: the most seconds to wait for an answer to a request."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 60.0) -> None:
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect

        self.url, self.timeout = ws_url(url), timeout
        self._stack = ExitStack()
        try:
            self._ws = self._stack.enter_context(connect(self.url, max_size=None, open_timeout=timeout))
        except (OSError, WebSocketException) as e:
            raise ConnectionError(f"cannot reach pie serve at {self.url}: {e}") from None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._following: dict[str, RemoteProcess] = {}
        self._closed: Detached | None = None
        self._reader = threading.Thread(target=self._read, name="pie-client", daemon=True)
        self._reader.start()
        if api_key:
            try:
                self._request({"type": "auth", "key": api_key})
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection: the processes it followed run on, detached."""
        self._stack.close()
        self._reader.join(self.timeout)

    # ---- the launch API's shape ----------------------------------------------------------------

    def submit(self, program: Any, input: Any = None, *, name: str | None = None,
               files: dict[str, bytes] | None = None, timeout: float | None = None,
               detach: bool = False) -> RemoteProcess:
        """Launch `program` (a .py file, a bundle folder or source text, as `Runtime.launch` takes)
        on `input`; the server's copy is used when it has one. The process is followed unless
        `detach`. `name`, `files` and `timeout` are `Runtime.launch`'s."""
        program = Program.load(program)
        launch = {"type": "launch", "hash": program_hash(program), "input": {} if input is None else input,
                  "files": dict(files or {}), "name": name, "timeout": timeout, "detach": detach}
        try:
            process = self._request(launch)
        except RequestError as e:
            if e.code != "not_found":
                raise
            self._request({"type": "upload", "program": program_payload(program)})
            process = self._request(launch)
        if detach:
            self._unfollow(process.id, "launched detached")
        return process

    def attach(self, process_id: str) -> RemoteProcess:
        """Follow a process launched with this key: what it sent while detached comes first."""
        return self._request({"type": "attach", "process": process_id})

    def ps(self) -> list[dict[str, Any]]:
        """This key's processes: {"process", "name", "state", "attached", "buffered", "age_s"}."""
        return self._request({"type": "ps"})["processes"]

    def saved(self) -> list[dict[str, Any]]:
        """The working sets this key's processes saved (`ws.save`): {"name", "state", "tokens"}."""
        return self._request({"type": "saved"})["saved"]

    def delete_saved(self, name: str) -> None:
        """Forget this key's saved working set `name` (RequestError "not_found": there is none)."""
        self._request({"type": "delete_saved", "name": name})

    def send(self, process_id: str, message: Any) -> None:
        """A message (text or a JSON value) for the process's `session.receive()`."""
        self._request({"type": "send", "process": process_id, "message": message})

    def send_file(self, process_id: str, data: bytes) -> None:
        """Binary data for the process's `session.receive_file()`."""
        self._request({"type": "send_file", "process": process_id, "data": bytes(data)})

    def kill(self, process_id: str) -> None:
        """End the process at its next host call (Failed "cancelled"); its KV pages return."""
        self._request({"type": "kill", "process": process_id})

    def wait(self, process_id: str, timeout: float | None = None) -> Any:
        """The process's output once it ends (its messages are not read); InferletError if it
        failed, TimeoutError after `timeout` seconds."""
        end = frame_event(self._ask({"type": "wait", "process": process_id}).result(timeout))
        if isinstance(end, Failed):
            raise end.error()
        return end.output

    # ---- the connection ------------------------------------------------------------------------

    def _request(self, frame: dict[str, Any]) -> Any:
        """Send a request and wait for its answer (RequestError for an error frame)."""
        return self._ask(frame).result(self.timeout)

    def _ask(self, frame: dict[str, Any]) -> Future:
        """Send a request: the future of its answer."""
        future: Future = Future()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            request_id = next(self._ids)
            self._pending[request_id] = future
        self._ws.send(encode({**frame, "id": request_id}, True))
        return future

    def _unfollow(self, process_id: str, why: str) -> None:
        with self._lock:
            process = self._following.pop(process_id, None)
        if process is not None:
            process._stream.put(Detached(f"process {process_id} is not followed by this client: {why}"))

    def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            for data in self._ws:
                self._dispatch(decode(data))
        except (ConnectionClosed, OSError):
            pass
        finally:
            with self._lock:
                self._closed = Detached(f"the connection to {self.url} closed")
                pending, self._pending = self._pending, {}
            for future in pending.values():
                future.set_exception(self._closed)
            for process_id in list(self._following):
                self._unfollow(process_id, "the connection closed")

    def _dispatch(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if "id" in frame:                          # an answer
            with self._lock:
                future = self._pending.pop(frame["id"], None)
            if future is None:
                return
            if kind == "error":
                future.set_exception(RequestError(frame["code"], frame["message"]))
            elif kind in ("launched", "attached"):
                # followed before the next frame is read: its events come right after this answer
                process = RemoteProcess(self, frame["process"], frame["name"])
                with self._lock:
                    self._following[process.id] = process
                future.set_result(process)
            else:
                future.set_result(frame)
        elif kind in EVENTS:
            with self._lock:
                process = self._following.get(frame["process"])
                if kind in ("done", "failed"):
                    self._following.pop(frame["process"], None)
            if process is not None:
                process.emit(frame_event(frame))
        elif kind == "detached":                   # another client attached it
            self._unfollow(frame["process"], frame.get("reason", "detached"))
