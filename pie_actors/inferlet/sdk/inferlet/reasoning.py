"""Separating a reply's thinking (`<think>...</think>`) from its answer as tokens are generated.

    cue = chat.cue()                       # or chat.cue_thinking(True)
    decoder = reasoning.Decoder.for_cue(cue)
    ... for each generated token:
        event = decoder.feed([token])
        Event.Start: thinking began      Event.Delta(text): more thinking
        Event.End(text): thinking over (text: all of it)      Event.Idle: nothing (answer text)

Templates that pre-fill the opening `<think>` in the cue (DeepSeek-R1, Qwen3 thinking models)
start the reply inside the block; a cue with an empty block (chat.cue_without_thinking on
Qwen3) means no thinking at all.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import _host

__all__ = ["Decoder", "Event"]


class Event:
    """What Decoder.feed returns."""

    @dataclass(frozen=True)
    class Idle:
        """Nothing new (outside the thinking block, or text that may be part of a tag)."""

    @dataclass(frozen=True)
    class Start:
        """The thinking block opened."""

    @dataclass(frozen=True)
    class Delta:
        """More thinking text."""
        text: str

    @dataclass(frozen=True)
    class End:
        """The thinking block closed; text is all of it (the deltas joined)."""
        text: str


def _event(e: dict):
    kind = e["type"]
    if kind == "start":
        return Event.Start()
    if kind == "delta":
        return Event.Delta(e["text"])
    return Event.End(e["text"])


class Decoder:
    """One reply's thinking block. `feed` returns one event; when a feed completes several,
    the rest come with the next feeds (consecutive deltas joined), so `feed([])` drains them."""

    def __init__(self, cue=()) -> None:
        self._handle = _host.call("reasoning.decoder", [int(t) for t in cue])
        self._queue: list = []

    @classmethod
    def for_cue(cls, cue) -> "Decoder":
        """A decoder for the reply that follows the tokens `cue` (the start of the turn)."""
        return cls(cue)

    def feed(self, tokens):
        """Generated tokens -> Event.Start, Event.Delta(text), Event.End(text) or Event.Idle."""
        events = _host.call("reasoning.feed", [self._handle, [int(t) for t in tokens]]) if tokens else []
        for e in map(_event, events):
            if isinstance(e, Event.Delta) and self._queue and isinstance(self._queue[-1], Event.Delta):
                self._queue[-1] = Event.Delta(self._queue[-1].text + e.text)
            else:
                self._queue.append(e)
        return self._queue.pop(0) if self._queue else Event.Idle()
