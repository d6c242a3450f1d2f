"""Talking to whoever started the inferlet (the terminal of `pie run`, a WebSocket client...)."""
from __future__ import annotations

import json

from . import _host
from wit_world.imports import host as _wit

__all__ = ["send", "receive"]


def send(message) -> None:
    """Stream `message` to the client now: text as is, anything else as JSON."""
    _host._check_live("send")
    if not isinstance(message, str):
        message = json.dumps(message, ensure_ascii=False)
    _wit.send(message)


async def receive():
    """The next message from the client (text, or the decoded JSON value it sent)."""
    return await _host.call_async("session.receive")
