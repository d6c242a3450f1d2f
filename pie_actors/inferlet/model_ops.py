"""The `model.*` host operations (`ModelOps`): the model's facts, and its tokenizer's encode / decode.

Receives the run's `RunState`, for the engine's `info`, the run's limits and the tokenizer.
"""
from __future__ import annotations

from typing import Any, Callable

from .host import HostOpError
from .run_state import RunState

__all__ = ["ModelOps", "FRAME_SIZE"]

FRAME_SIZE = 1               # passes per scheduler frame, as model.frame_size() reports it


class ModelOps:
    def __init__(self, run: RunState) -> None:
        self.run = run

    def ops(self) -> dict[str, Callable[[Any], Any]]:
        return {"model.info": self.info, "model.encode": self.encode, "model.decode": self.decode}

    def info(self, args: Any) -> dict[str, Any]:
        info, limits = self.run.info, self.run.limits
        return {"name": info["model"], "architecture": info["architecture"],
                "output_vocab_size": info["vocab_size"], "kv_page_size": info["page_size"],
                "frame_size": FRAME_SIZE, "channel_capacity": limits.channel_capacity,
                "run_ahead_window": limits.run_ahead_window, "max_position": info["max_position"]}

    def encode(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise HostOpError("model.encode takes a string")
        return self.run.tok.encode(text)

    def decode(self, args: Any) -> str:
        """The text of a list of ids, or of {"tokens", "after"}: the text after the first `after`
        ids' text."""
        tokens, after = (args.get("tokens"), args.get("after")) if isinstance(args, dict) else (args, 0)
        if not isinstance(tokens, list) or any(type(t) is not int for t in tokens):
            raise HostOpError("model.decode takes a list of token ids")
        if type(after) is not int or not 0 <= after <= len(tokens):
            raise HostOpError(f"model.decode: after={after!r} is not a count of the {len(tokens)} ids")
        try:
            text = self.run.tok.decode(tokens)
            return text[len(self.run.tok.decode(tokens[:after])):] if after else text
        except ValueError as e:
            raise HostOpError(str(e)) from None
