"""Talking to whoever started the inferlet (the terminal of `pie run`, a client of `pie serve`...)
and to other inferlet processes of the same cluster."""
from __future__ import annotations

import base64
import json

from . import _host
from wit_world.imports import host as _wit

__all__ = ["send", "receive", "send_file", "receive_file", "file", "send_to"]


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
    """Deliver `message` (text or a JSON value) to the named inferlet process; it gets it from
    its `session.receive()`. Processes are named at launch (`pie run --name`)."""
    _host.call("session.send_to", [str(process), message])
