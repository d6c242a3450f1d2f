"""`EngineLink`: the engine connection as the working-set, channel and pass glue classes share it.

A run whose engine is chosen at its first pass (run_state.EngineChoice) keeps the working sets,
channels, channel puts and programs it makes before that pass as steps, and sends them once the
pass has chosen (`client`): the tokens of that pass's first lane are the prefix the replica is
chosen by. Any other engine operation before it chooses by load alone. Each glue class keeps its
own handles, mapped to the engine's ids (None until a step has made it).
"""
from __future__ import annotations

from typing import Awaitable, Callable

from .engine_client import EngineClient
from .host import HostOpError
from .run_state import CONNECT_TIMEOUT_S, RunState

__all__ = ["EngineLink", "Step"]

Step = Callable[[EngineClient], Awaitable[None]]


class EngineLink:
    def __init__(self, run: RunState) -> None:
        self.run = run
        self._steps: list[Step] = []     # what was made before the engine was chosen, in order
        self.lost_steps = ""              # why they were not all sent, if so

    def client(self, prefix: list[int] | None = None) -> EngineClient:
        """The engine connection. A run whose engine is not chosen yet chooses it now (by `prefix`,
        the first pass's tokens, when known) and sends what it made meanwhile first."""
        if self.run.bound:
            return self.run.client
        client = self.run.bind(prefix)
        steps, self._steps = self._steps, []

        async def replay() -> None:
            for step in steps:
                await step(client)
        try:
            self.run.wait(replay(), CONNECT_TIMEOUT_S)
        except HostOpError as e:
            self.lost_steps = f"what the run made before its engine was chosen was refused: {e}"
            raise HostOpError(self.lost_steps) from None
        return client

    def engine_id(self, ids: dict[int, int | None], handle: int, what: str) -> int:
        """`ids[handle]`, the engine's id of the `what` the run calls `handle`; one made before the
        engine was chosen makes the choice now."""
        if ids[handle] is None:
            self.client()
        if ids[handle] is None:
            raise HostOpError(f"{what} {handle} was not made: {self.lost_steps}")
        return ids[handle]

    def now_or_later(self, step: Step) -> None:
        """Run `step` on the engine now, or, before the engine is chosen, once it is."""
        if self.run.bound:
            self.run.wait(step(self.run.client))
        else:
            self._steps.append(step)
