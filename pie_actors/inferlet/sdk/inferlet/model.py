"""The model the inferlet runs on: its tokenizer and the engine's runtime constants.

Every function is a host operation (the tokenizer lives on the host; nothing bulky crosses).
The constants are asked for once per run and remembered.
"""
from __future__ import annotations

from . import _host

__all__ = ["encode", "decode", "name", "architecture", "output_vocab_size", "kv_page_size",
           "frame_size", "channel_capacity", "run_ahead_window", "max_position", "draft_block", "switches",
           "switch"]

_info: dict | None = None   # filled on first use inside a run (the snapshot is taken empty)


def _get(key: str):
    global _info
    if _info is None:
        _info = _host.call("model.info")
    return _info[key]


def encode(text: str) -> list[int]:
    """Token ids of `text` (no BOS/EOS added: see chat.prefix())."""
    return _host.call("model.encode", str(text))


def decode(tokens, after: int = 0) -> str:
    """Text of token ids. With `after`, the text that follows the first `after` ids' own text: a
    streamed piece decoded in the context of the ids before it (spaces and merged characters
    come out right), in one host call."""
    ids = [int(t) for t in tokens]
    return _host.call("model.decode", {"tokens": ids, "after": int(after)} if after else ids)


def name() -> str:
    return _get("name")


def architecture() -> str:
    return _get("architecture")


def output_vocab_size() -> int:
    return _get("output_vocab_size")


def kv_page_size() -> int:
    return _get("kv_page_size")


def frame_size() -> int:
    return _get("frame_size")


def channel_capacity() -> int:
    return _get("channel_capacity")


def run_ahead_window() -> int:
    return _get("run_ahead_window")


def max_position() -> int:
    """The model's context length: the most tokens one working set may hold."""
    return _get("max_position")


def draft_block():
    """The model's speculative draft head; None: no draft head was imported with this model."""
    return None


def switches() -> list[str]:
    """Execution modes the model declares (e.g. diffusion steps); attention-only LMs have none."""
    return []


def switch(switch_name: str):
    """The mode switch `switch_name`; a ValueError names the ones the model has."""
    raise ValueError(f"the model {name()!r} declares no switch {switch_name!r} "
                     f"(it has: {', '.join(switches()) or 'none'})")
