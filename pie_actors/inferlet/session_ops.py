"""The `session.*` host operations (`SessionOps`): talking to the client and to other inferlet processes.

It receives the run's `RunState` (for its futures, limits and `emit`), the files attached to the run
and the run's `Peers` (peers.py: the owner's other processes). Text goes to the client through the
WIT `send` import (`HostApi.send`); everything else is a host operation here. Binary data crosses
the JSON boundary as base64 text. Messages reach a run from any thread (its client, or another
process's `send_to`) through `deliver` / `deliver_file` and are handed, in order, to the guest's
pending `receive` / `receive_from` / `receive_file` futures. The mailbox is bounded for messages
from processes (`limits.mailbox_size`: a sender finding it full waits, then fails); the client's
messages are always taken. A run that waits for a message parks after `limits.park_after_s`
(`RunState.on_receive`, pass_ops.py).
"""
from __future__ import annotations

import base64
from typing import Any

from typing_extensions import TypedDict

from ..process import File
from .host import HostOpError, Inbox
from .host_op import Name, host_op, shape
from .peers import Peers, send_within
from .run_state import RunState

__all__ = ["SessionOps"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise HostOpError(f"{what}: invalid base64 data") from None


@shape
class Data(TypedDict):
    data: str          # base64


@shape
class SendTo(TypedDict):
    to: str            # a process name
    message: Any


class SessionOps:
    interface = "session"

    def __init__(self, run: RunState, files: dict[str, bytes] | None, peers: Peers | None) -> None:
        self.run = run
        self.files = dict(files or {})
        self.peers = peers
        self.inbox = Inbox(run.futures, convert=_message, capacity=run.limits.mailbox_size)   # (sender, message)
        self.file_inbox = Inbox(run.futures)

    def deliver(self, message: Any, sender: str | None = None) -> bool:
        """A message for `session.receive` (any thread): from the client (`sender` None: always
        taken), or from process `sender` (False, not taken, when the mailbox is full)."""
        if sender is None:
            self.inbox.put((None, message))
            return True
        return self.inbox.offer((sender, message))

    def deliver_file(self, data: bytes) -> None:
        """Binary data for `session.receive_file` (any thread)."""
        self.file_inbox.put(_b64(data))

    @host_op("session.receive")
    def receive(self) -> int:
        return self._waiting(self.inbox.receive())

    @host_op("session.receive_from")
    def receive_from(self) -> int:
        return self._waiting(self.inbox.receive(convert=list))

    def _waiting(self, fid: int) -> int:
        # a run that waits long for a message parks (pass_ops.py)
        if self.run.on_receive is not None:
            self.run.on_receive(fid)
        return fid

    @host_op("session.receive_file")
    def receive_file(self) -> int:
        return self.file_inbox.receive()

    @host_op("session.send_file", Data)
    def send_file(self, data: str) -> None:
        self.run.emit(File(_unb64(data, "session.send_file")))

    @host_op("session.file", Name)
    def file(self, name: str) -> str:
        if name not in self.files:
            attached = ", ".join(sorted(self.files)) or "none"
            raise HostOpError(f"no file named {name!r} was attached (attached: {attached}; "
                              "attach files with pie run --file name=path)")
        return _b64(self.files[name])

    @host_op("session.send_to", SendTo, wire="list")
    def send_to(self, to: str, message: Any) -> None:
        if self.peers is None:
            raise HostOpError("session.send_to needs named processes: launch the inferlet through the "
                              "launch API (pie run, Runtime.launch)")
        send_within(self.peers, to, message, self.run.time_left(self.run.limits.send_timeout_s))


def _message(item: tuple[str | None, Any]) -> Any:
    return item[1]
