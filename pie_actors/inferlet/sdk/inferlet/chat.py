"""Chat formatting as token ids, from the active model's chat template (rendered on the host).

Each function returns the tokens of one piece of a conversation, so that concatenating
them gives the tokens of the whole rendered conversation, e.g.
``chat.system(a) + chat.user(b) + chat.cue()`` is the template's rendering of
[system a, user b] with the generation prompt. After a generated reply whose stop token was
not fed back, ``chat.seal()`` closes the turn, and ``chat.user(...)`` continues it.
"""
from __future__ import annotations

from . import _host

__all__ = ["prefix", "system", "user", "assistant", "system_user", "first_user", "system_thinking",
           "cue", "cue_without_thinking", "cue_thinking", "seal", "stop_tokens"]

_fixed: dict[str, list[int]] = {}   # per-run cache of the pieces that take no text


def _piece(kind: str, args=None) -> list[int]:
    key = kind if args is None else f"{kind}:{args}"
    tokens = _fixed.get(key)
    if tokens is None:
        tokens = _fixed[key] = _host.call("chat." + kind, args)
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
    """A complete assistant turn (as history before a later user turn)."""
    return _host.call("chat.assistant", str(text))


def system_user(system: str, user: str) -> list[int]:
    """The opening system and user turns together, for templates that combine them."""
    return _host.call("chat.system_user", [str(system), str(user)])


def first_user(text: str) -> list[int]:
    """The opening user turn of a conversation without a system message (with whatever the
    template puts first: a default system message, a date header...)."""
    return _host.call("chat.first_user", str(text))


def system_thinking(text: str, effort: str) -> list[int]:
    """A system turn that sets the reasoning effort ("none", "low", "medium" or "high") the way
    the template can (a reasoning_effort setting; Qwen3's /think and /no_think); a plain system
    turn for models without such a control."""
    return _host.call("chat.system_thinking", [str(text), str(effort)])


def cue() -> list[int]:
    """The start of the assistant's reply (reasoning models may think first)."""
    return _piece("cue")


def cue_without_thinking() -> list[int]:
    """The start of the assistant's reply, telling reasoning models to skip their thinking."""
    return _piece("cue_without_thinking")


def cue_thinking(thinking: bool) -> list[int]:
    """The start of the reply with thinking on (as the template writes it, e.g. an opening
    <think>) or off (cue_without_thinking)."""
    return _piece("cue_thinking", bool(thinking))


def seal() -> list[int]:
    """The end of the current assistant turn (e.g. <|im_end|> and a newline): append it after a
    reply whose stop token was not fed back, before the next turn."""
    return _piece("seal")


def stop_tokens() -> list[int]:
    """Token ids that end a reply: the model's end-of-sequence ids and its end-of-turn token."""
    return _piece("stop_tokens")
