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

    def decode(self, tokens: Any) -> str:
        if not isinstance(tokens, list) or any(type(t) is not int for t in tokens):
            raise HostOpError("model.decode takes a list of token ids")
        try:
            return self.run.tok.decode(tokens)
        except ValueError as e:
            raise HostOpError(str(e)) from None
