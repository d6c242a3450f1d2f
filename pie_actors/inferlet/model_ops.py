"""The `model.*` host operations (`ModelOps`): the model's facts, and its tokenizer's encode / decode.

Receives the run's `RunState`, for the engine's `info`, the run's limits and the tokenizer.
"""
from __future__ import annotations

from typing import Any

from typing_extensions import TypedDict

from .host import HostOpError
from .host_op import Text, host_op, shape
from .run_state import RunState

__all__ = ["ModelOps", "FRAME_SIZE"]

FRAME_SIZE = 1               # passes per scheduler frame, as model.frame_size() reports it


@shape
class TokensAfter(TypedDict):
    tokens: list[int]
    after: int


@shape
class Decode(TypedDict):
    ids: list[int] | TokensAfter


class ModelOps:
    interface = "model"

    def __init__(self, run: RunState) -> None:
        self.run = run

    @host_op("model.info")
    def info(self) -> dict[str, Any]:
        info, limits = self.run.info, self.run.limits
        return {"name": info["model"], "architecture": info["architecture"],
                "output_vocab_size": info["vocab_size"], "kv_page_size": info["page_size"],
                "frame_size": FRAME_SIZE, "channel_capacity": limits.channel_capacity,
                "run_ahead_window": limits.run_ahead_window, "max_position": info["max_position"]}

    @host_op("model.encode", Text)
    def encode(self, text: str) -> list[int]:
        return self.run.tok.encode(text)

    @host_op("model.decode", Decode)
    def decode(self, ids: list[int] | TokensAfter) -> str:
        """The text of a list of ids, or of {"tokens", "after"}: the text after the first `after`
        ids' text."""
        tokens, after = (ids["tokens"], ids["after"]) if isinstance(ids, dict) else (ids, 0)
        if not 0 <= after <= len(tokens):
            raise HostOpError(f"model.decode: after={after!r} is not a count of the {len(tokens)} ids")
        try:
            text = self.run.tok.decode(tokens)
            return text[len(self.run.tok.decode(tokens[:after])):] if after else text
        except ValueError as e:
            raise HostOpError(str(e)) from None
