"""Tool calling in the model's own format (Hermes/Qwen `<tool_call>` JSON or Llama 3.1 JSON,
chosen from the chat template on the host).

    prompt = tools.equip(specs) + chat.user(question) + chat.cue()
    decoder = tools.Decoder()
    ... for each generated token:
        event = decoder.feed([token])
        if isinstance(event, tools.Event.Call):
            result = run_my_tool(event.call.name, event.call.arguments)
    ... after the reply (its stop token not fed back):
    prompt = chat.seal() + tools.answer(name, result) + chat.cue()

`specs` are JSON function schemas, {"type": "function", "function": {"name", "description",
"parameters"}} or the bare function object.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from . import _host
from .grammar import Grammar, Matcher

__all__ = ["equip", "answer", "format", "create_matcher", "Decoder", "Event", "ToolCall"]


def equip(specs, system: str | None = None) -> list[int]:
    """The opening turn that declares the tools `specs` (with the system message `system`, when
    given), the way the model's template writes it; follow it with chat.user(...)."""
    return _host.call("tools.equip", {"specs": specs, "system": system})


def answer(name: str, value) -> list[int]:
    """A turn that gives tool `name`'s result `value` (text as is, anything else as JSON)."""
    return _host.call("tools.answer", [str(name), value])


def format(specs) -> Grammar:
    """The grammar of valid calls to `specs` in the model's call syntax (one or more calls)."""
    return Grammar(_host.call("tools.grammar", specs))


def create_matcher(specs) -> Matcher:
    """A Matcher that admits only valid calls to `specs`."""
    return Matcher(format(specs))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments_json: str

    @property
    def arguments(self) -> dict:
        return json.loads(self.arguments_json)


class Event:
    """What Decoder.feed returns."""

    @dataclass(frozen=True)
    class Idle:
        """Nothing new."""

    @dataclass(frozen=True)
    class Start:
        """A tool call began."""

    @dataclass(frozen=True)
    class Call:
        """A complete, well-formed call."""
        call: ToolCall

    @dataclass(frozen=True)
    class Error:
        """Call text that does not parse (bad JSON, no name, arguments not an object, or a reply
        that ended inside a call): the message says which; text is the call's text."""
        message: str
        text: str


def _event(e: dict):
    kind = e["type"]
    if kind == "start":
        return Event.Start()
    if kind == "call":
        return Event.Call(ToolCall(e["name"], e["arguments_json"]))
    return Event.Error(e["message"], e["text"])


class Decoder:
    """Finds tool calls in one reply as its tokens are fed. `feed` returns one event per call;
    when one feed completes several (a chunk with a whole call), the rest come with the next
    feeds, so `feed([])` drains them (Idle when there are none)."""

    def __init__(self) -> None:
        self._handle = _host.call("tools.decoder")
        self._queue: list = []

    def _next(self, events: list[dict]):
        self._queue += [_event(e) for e in events]
        return self._queue.pop(0) if self._queue else Event.Idle()

    def feed(self, tokens):
        """Generated tokens -> Event.Start, Event.Call(call), Event.Error(message, text) or Event.Idle."""
        tokens = [int(t) for t in tokens]
        return self._next(_host.call("tools.feed", [self._handle, tokens]) if tokens else [])

    def finish(self):
        """The reply is over: a call left open becomes Event.Error (else the next queued event, or Idle)."""
        return self._next(_host.call("tools.finish", self._handle))
