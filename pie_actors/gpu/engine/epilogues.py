"""Epilogues of data-plane passes: a spec from the wire -> a function of the pass's read-out logits.

They run on the engine thread, next to the logits; only their (small) outputs cross the wire.
Kinds: "argmax" (one token per read-out row), "logits" (the rows as a float32 tensor), and
"program": a compiled eta program (`pie_actors.gpu.eta`) the connection registered, run with a
`PassEnv` that gives it the pass's logits per lane and the connection's channels.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from . import wire
from .channels import ChannelError, ChannelStore
from .scheduler import Epilogue, RowEpilogue
from ..eta import EtaError, Program, argmax

__all__ = ["EpilogueError", "PassEnv", "program_epilogue", "lanes_program_epilogue", "PassesEnv", "prologue_runner",
           "adapter_fn", "SIMPLE", "SIMPLE_EPILOGUES", "ROWS_EPILOGUES"]

class EpilogueError(RuntimeError):
    """An epilogue failed on its logits, or returned something that cannot be sent."""


def _argmax(logits: torch.Tensor) -> list[int]:
    return argmax(logits).tolist()


def _logits(logits: torch.Tensor) -> Any:
    data = logits.float().cpu().numpy().astype("<f4", copy=False).tobytes()
    return wire.tensor("f", list(logits.shape), data)


SIMPLE: dict[str, Epilogue] = {"argmax": _argmax, "logits": _logits}
# the same, once for the single read-out rows of many passes (each pass's result: a list of one token)
ROWS_EPILOGUES: dict[str, RowEpilogue] = {
    "argmax": RowEpilogue("argmax", lambda rows, _: [[token] for token in argmax(rows).tolist()])}


def _guarded(name: str, run: Epilogue) -> Epilogue:
    def guarded(logits: torch.Tensor) -> Any:
        try:
            return run(logits)
        except (EtaError, ChannelError) as e:      # the program's own fault: its message says why
            raise EpilogueError(f"epilogue {name} failed: {e}") from e
        except Exception as e:
            raise EpilogueError(f"epilogue {name} failed: {type(e).__name__}: {e}") from e
    return guarded


SIMPLE_EPILOGUES: dict[str, Epilogue] = {kind: _guarded(repr(kind), run) for kind, run in SIMPLE.items()}


class PassEnv:
    """The eta Env of one pass: its logits split by lane, and the channels its connection owns."""

    def __init__(self, logits: torch.Tensor | None, rows_per_lane: list[int], channels: ChannelStore,
                 owned: set[int], args: tuple[torch.Tensor, ...] = ()) -> None:
        self.logits, self.rows_per_lane = logits, rows_per_lane
        self.channels, self.owned = channels, owned
        self.args = args
        self.starts = [0]
        for n in rows_per_lane:
            self.starts.append(self.starts[-1] + n)

    def output(self, lane: int, name: str) -> torch.Tensor:
        if name != "logits":
            raise LookupError(f"the model has no output {name!r} (it has: 'logits')")
        if self.logits is None:
            raise LookupError("a prologue runs before the model: it has no model outputs")
        if not 0 <= lane < len(self.rows_per_lane):
            raise LookupError(f"lane {lane} does not exist: the pass has {len(self.rows_per_lane)} lane(s)")
        rows = self.logits[self.starts[lane]:self.starts[lane + 1]].float()
        return rows[0] if len(rows) == 1 else rows

    def _check(self, channel: int) -> int:
        if channel not in self.owned:
            raise LookupError(f"channel {channel} does not exist (never created by this inferlet, or freed)")
        return channel

    def take(self, channel: int) -> torch.Tensor:
        try:
            return self.channels.take(self._check(channel))
        except ChannelError as e:
            raise LookupError(str(e)) from None

    def put(self, channel: int, value: torch.Tensor) -> None:
        try:
            self.channels.put(self._check(channel), value)
        except ChannelError as e:
            raise LookupError(str(e)) from None

    def indptr(self) -> torch.Tensor:
        return torch.tensor(self.starts, dtype=torch.int32)

    def arg(self, index: int) -> torch.Tensor:
        if not index < len(self.args):
            raise LookupError(f"argument {index} does not exist (only adapter functions f(x, y) have arguments)")
        return self.args[index]


def _wire(values: list[torch.Tensor]) -> list[Any]:
    return [v.tolist() for v in values]


def program_epilogue(program: Program, rows_per_lane: list[int], channels: ChannelStore,
                     owned: set[int]) -> Epilogue:
    """Run `program` on a pass's read-out logits; returns its outputs as lists/numbers."""
    def run(logits: torch.Tensor) -> list[Any]:
        return _wire(program.run(PassEnv(logits, rows_per_lane, channels, owned)))
    return _guarded(f"program {program.hash[:12]}", run)


class PassesEnv:
    """The eta LanesEnv of one-row passes that run a program once for all (`Program.run_lanes`):
    their rows, and each pass's channels, bound by position to the first pass's (the programs
    differ only in their channel ids). Puts wait for `commit`, and what it takes is kept in
    `taken` (a ChannelStore snapshot), so a run that fails can be undone."""

    def __init__(self, rows: torch.Tensor, members: list[tuple[Program, set[int]]], channels: ChannelStore) -> None:
        self.rows, self.channels, self.passes = rows, channels, len(members)
        first = members[0][0].slots
        self.bound = {cid: [program.slots[i] for program, _ in members] for i, cid in enumerate(first)}
        if any(cid not in owned for program, owned in members for cid in program.slots):
            raise LookupError("a pass names a channel that is not its own")   # each pass alone says which
        self.puts: list[tuple[int, torch.Tensor, bool]] = []
        self.taken: dict[int, list[torch.Tensor]] = {}

    def output(self, lane: int, name: str) -> torch.Tensor:
        if (lane, name) != (0, "logits"):
            raise LookupError(f"lane {lane} {name!r}: passes run together read lane 0's logits")
        return self.rows

    def take(self, channel: int) -> torch.Tensor:
        cids = self.bound[channel]
        self.taken.update(self.channels.snapshot(cids))
        return torch.stack([self.channels.take(cid) for cid in cids])

    def put(self, channel: int, value: torch.Tensor, per_pass: bool) -> None:
        self.puts.append((channel, value, per_pass))

    def commit(self) -> list[Exception | None]:
        """The puts, in program order, each for all passes at once; the error of a pass whose put
        failed (its later puts are not made, as when it runs alone)."""
        errors: list[Exception | None] = [None] * self.passes
        for channel, value, per_pass in self.puts:
            going = [p for p in range(self.passes) if errors[p] is None]
            cids = [self.bound[channel][p] for p in going]
            rows = (value[going] if len(going) < self.passes else value) if per_pass else \
                value.expand(len(going), *value.shape)
            for p, error in zip(going, self.channels.put_rows(cids, rows)):
                if error is not None:
                    errors[p] = EpilogueError(f"epilogue failed: {error}")
        return errors


def lanes_program_epilogue(program: Program, channels: ChannelStore, owned: set[int]) -> RowEpilogue:
    """A `lanewise` program run once for the single read-out rows of many passes, each pass's
    channels its own (its connection's `owned`); a run that fails gives back what it took."""
    def run(rows: torch.Tensor, members: list[RowEpilogue]) -> list[Any]:
        env = PassesEnv(rows, [m.own for m in members], channels)
        try:
            columns = [value.tolist() for value in program.run_lanes(env)]
        except Exception:
            channels.restore(env.taken)
            raise
        errors = env.commit()
        outputs = list(zip(*columns)) or [()] * len(members)
        return [error or list(out) for error, out in zip(errors, outputs)]
    return RowEpilogue(program.lane_key, run, (program, owned))


def adapter_fn(program: Program, channels: ChannelStore, owned: set[int]) -> Callable:
    """f(x, y) -> new y at a projection site (it runs inside the model, once per layer it applies to)."""
    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        outputs = program.run(PassEnv(None, [], channels, owned, (x.float(), y.float())))
        if len(outputs) != 1:
            raise EtaError(f"an adapter returns one tensor (the new projection output), not {len(outputs)}")
        return outputs[0]
    return run


def prologue_runner(program: Program, channels: ChannelStore, owned: set[int]) -> Callable[[], None]:
    """Run `program` before a pass (channels only: there are no model outputs yet)."""
    def run() -> None:
        program.run(PassEnv(None, [], channels, owned))
    return run
