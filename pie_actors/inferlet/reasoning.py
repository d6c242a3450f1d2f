"""Separating a reply's thinking block (`<think>...</think>`) from its answer, as tokens stream in.

`ReasoningDecoder` is the host half of the SDK's `reasoning.Decoder`. It reads the decoded text
of the generated tokens (tags may be one added token, as in Qwen3, or spelled in several
ordinary tokens) and reports events as plain dicts:

    {"type": "start"}                  the thinking block opened
    {"type": "delta", "text": str}     more thinking text
    {"type": "end", "text": str}       the block closed; text is all of it (the deltas joined)

Every split of the same token stream gives the same start/end events and the same joined
delta text: text that might be the beginning of a tag is held back until it is not.
"""
from __future__ import annotations

from .textstream import TextStream, tag_prefix_len

__all__ = ["ReasoningDecoder", "OPEN", "CLOSE"]

OPEN, CLOSE = "<think>", "</think>"

_BEFORE, _INSIDE, _AFTER = "before", "inside", "after"



class ReasoningDecoder:
    """One reply's thinking block. `opened`: the cue already wrote the opening tag (templates
    that pre-fill `<think>\\n`), so the reply starts inside the block; `closed`: the cue holds a
    whole (empty) block, so the reply has no thinking."""

    def __init__(self, tokenizer, opened: bool = False, closed: bool = False) -> None:
        self._text = TextStream(tokenizer)
        self._state = _AFTER if closed else (_INSIDE if opened else _BEFORE)
        self._announce = opened and not closed   # Start is reported with the first feed
        self._pending = ""                       # text not yet classified
        self._thinking: list[str] = []

    @classmethod
    def for_cue(cls, tokenizer, cue: list[int]) -> ReasoningDecoder:
        """A decoder for the reply that follows `cue` (the tokens that started the turn)."""
        text = tokenizer.decode(list(cue))
        opened_at, closed_at = text.rfind(OPEN), text.rfind(CLOSE)
        return cls(tokenizer, opened=opened_at > closed_at, closed=closed_at > opened_at)

    def feed(self, tokens: list[int]) -> list[dict]:
        text = self._text.feed(tokens)           # first: a bad id changes nothing
        events: list[dict] = []
        if self._announce:
            self._announce = False
            events.append({"type": "start"})
        self._pending += text
        if self._state == _BEFORE:
            self._before(events)
        if self._state == _INSIDE:
            self._inside(events)
        if self._state == _AFTER:
            self._pending = ""
        return events

    def _before(self, events: list[dict]) -> None:
        # only a block at the very start of the reply (after blank space) is a thinking block
        head = self._pending.lstrip()
        if head.startswith(OPEN):
            self._pending = head[len(OPEN):]
            self._state = _INSIDE
            events.append({"type": "start"})
        elif not OPEN.startswith(head):
            self._state = _AFTER

    def _inside(self, events: list[dict]) -> None:
        end = self._pending.find(CLOSE)
        if end >= 0:
            self._delta(events, self._pending[:end])
            self._pending = self._pending[end + len(CLOSE):]
            self._state = _AFTER
            events.append({"type": "end", "text": "".join(self._thinking)})
            return
        keep = tag_prefix_len(self._pending, CLOSE)
        self._delta(events, self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]

    def _delta(self, events: list[dict], text: str) -> None:
        if text:
            self._thinking.append(text)
            events.append({"type": "delta", "text": text})
