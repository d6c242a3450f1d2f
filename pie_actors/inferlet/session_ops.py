"""The `session.*` host operations (`SessionOps`): talking to the client and to other inferlet processes.

It receives the run's `RunState` (for its futures and `emit`), the files attached to the run and
the `send_to` of named processes. Text goes to the client through the WIT `send` import
(`HostApi.send`); everything else is a host operation here. Binary data crosses the JSON boundary
as base64 text. Messages reach a run from any thread (its client, or another process's `send_to`)
through `deliver` / `deliver_file` and are handed, in order, to the guest's pending `receive` /
`receive_file` futures.
"""
from __future__ import annotations

import base64
from typing import Any, Callable

from ..process import File
from .host import HostOpError, Inbox
from .run_state import RunState

__all__ = ["SessionOps"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise HostOpError(f"{what} takes base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise HostOpError(f"{what}: invalid base64 data") from None


class SessionOps:
    def __init__(self, run: RunState, files: dict[str, bytes] | None,
                 send_to: Callable[[str, Any], None] | None) -> None:
        self.run = run
        self.files = dict(files or {})
        self.send_to = send_to
        self.inbox = Inbox(run.futures)
        self.file_inbox = Inbox(run.futures)

    def ops(self) -> dict[str, Callable[[Any], Any]]:
        return {"session.receive": self.receive, "session.receive_file": self.receive_file,
                "session.send_file": self.send_file, "session.file": self.file,
                "session.send_to": self.send_message_to}

    def deliver(self, message: Any) -> None:
        """A message for `session.receive` (from the client or another process; any thread)."""
        self.inbox.put(message)

    def deliver_file(self, data: bytes) -> None:
        """Binary data for `session.receive_file` (any thread)."""
        self.file_inbox.put(_b64(data))

    def receive(self, args: Any) -> int:
        return self.inbox.receive()

    def receive_file(self, args: Any) -> int:
        return self.file_inbox.receive()

    def send_file(self, data: Any) -> None:
        self.run.emit(File(_unb64(data, "session.send_file")))

    def file(self, name: Any) -> str:
        if name not in self.files:
            attached = ", ".join(sorted(self.files)) or "none"
            raise HostOpError(f"no file named {name!r} was attached (attached: {attached}; "
                              "attach files with pie run --file name=path)")
        return _b64(self.files[name])

    def send_message_to(self, args: Any) -> None:
        if not (isinstance(args, list) and len(args) == 2 and isinstance(args[0], str)):
            raise HostOpError("session.send_to takes a process name and a message")
        if self.send_to is None:
            raise HostOpError("session.send_to needs named processes: run the inferlet on a Ray "
                              "cluster (pie run without --local)")
        self.send_to(args[0], args[1])
