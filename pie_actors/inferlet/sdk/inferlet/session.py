"""Talking to whoever started the inferlet (the terminal of `pie run`, a client of `pie serve`...)
and to other inferlet processes of the same cluster."""
from __future__ import annotations

import base64
import json

from . import _host
from wit_world.imports import host as _wit

__all__ = ["send", "receive", "receive_from", "send_file", "receive_file", "file", "send_to"]


def send(message) -> None:
    """Stream `message` to the client now: text as is, anything else as JSON."""
    _host._check_live("send")
    if not isinstance(message, str):
        message = json.dumps(message, ensure_ascii=False)
    _wit.send(message)


async def receive():
    """The next message for this process: from its client, or from another process's
    `send_to` (text, or the JSON value that was sent)."""
    return await _host.call_async("session.receive")


async def receive_from():
    """`receive()`, with who sent it: (sender, message), the sender being the name of the process
    whose `send_to` sent it, or None for the client. Both draw from the one mailbox, in order."""
    sender, message = await _host.call_async("session.receive_from")
    return sender, message


def send_file(data: bytes) -> None:
    """Send binary data to the client."""
    _host.call("session.send_file", base64.b64encode(bytes(data)).decode("ascii"))


async def receive_file() -> bytes:
    """The next binary message from the client."""
    return base64.b64decode(await _host.call_async("session.receive_file"))


def file(name: str) -> bytes:
    """The contents of the file attached at launch as `pie run --file name=path`."""
    return base64.b64decode(_host.call("session.file", str(name)))


def send_to(process: str, message) -> None:
    """Deliver `message` (text or a JSON value) to the named inferlet process of the same owner;
    it gets it from its `session.receive()` (or `receive_from()`). Processes are named at launch
    (`pie run --name`, `runtime.spawn(name=...)`). Returns once the message is in the process's
    mailbox, so one sender's messages arrive in order; a full mailbox makes it wait, up to the
    config's `send_timeout_s`. A process that is not running is a HostError at once. `process` is a
    name, or a child from `runtime.spawn`."""
    _host.call("session.send_to", [str(getattr(process, "name", process)), message])
