"""Chat formatting as token ids, from the active model's chat template (rendered on the host).

Each function returns the tokens of one piece of a conversation, so that concatenating
them gives the tokens of the whole rendered conversation, e.g.
``chat.system(a) + chat.user(b) + chat.cue()`` is the template's rendering of
[system a, user b] with the generation prompt.
"""
from __future__ import annotations

from . import _host

__all__ = ["prefix", "system", "user", "assistant", "cue", "cue_without_thinking", "stop_tokens"]

_fixed: dict[str, list[int]] = {}   # per-run cache of the pieces that take no text


def _piece(kind: str) -> list[int]:
    tokens = _fixed.get(kind)
    if tokens is None:
        tokens = _fixed[kind] = _host.call("chat." + kind)
    return list(tokens)


def prefix() -> list[int]:
    """The model's opening (BOS) tokens for raw prompts (empty when the model uses none)."""
    return _piece("prefix")


def system(text: str) -> list[int]:
    """A system turn (opening the conversation)."""
    return _host.call("chat.system", str(text))


def user(text: str) -> list[int]:
    """A user turn."""
    return _host.call("chat.user", str(text))


def assistant(text: str) -> list[int]:
    """A complete assistant turn."""
    return _host.call("chat.assistant", str(text))


def cue() -> list[int]:
    """The start of the assistant's reply (reasoning models may think first)."""
    return _piece("cue")


def cue_without_thinking() -> list[int]:
    """The start of the assistant's reply, telling reasoning models to skip their thinking."""
    return _piece("cue_without_thinking")


def stop_tokens() -> list[int]:
    """Token ids that end a reply: the model's end-of-sequence ids and its end-of-turn token."""
    return _piece("stop_tokens")
