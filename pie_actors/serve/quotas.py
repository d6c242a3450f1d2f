"""Per-key quotas of pie serve (`[serve.quotas]`): how many inferlets a key may run at once, how many
tokens its requests and processes may use a minute, and how many KV pages its processes may hold together.

    [serve.quotas]
    default = {inferlets = 8, tokens_per_minute = 100000, kv_pages = 2048}
    "some-key" = {inferlets = 2}          # the default's other fields still apply to it

A bound left out (or 0) is no bound. Over a bound, a launch is refused with ApiError("rate_limited"):
each API answers 429 in its own shape, the WebSocket an error frame of that code. Running inferlets
are counted by the runtime (`Runtime.running`), so every front door's launches count, and a key
can launch again once one of its inferlets has ended. Tokens are those of the API requests (their
usage) and of the WebSocket processes (what the engine ran for each, `Done.tokens`) that ended in
the last minute. The KV page bound travels with each launch to the engine (`RunLimits.kv_pages`),
which fails the allocation that would go past it (kvstore `QuotaExceeded`); a hybrid model's
recurrent-state slots count in it as the pages their bytes fill.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from ..config import RunLimits
from .auth import owner_of
from .errors import ApiError

__all__ = ["Quota", "Quotas", "WINDOW_S"]

WINDOW_S = 60.0          # the window tokens_per_minute counts over


@dataclass(frozen=True)
class Quota:
    """One key's bounds; 0 is no bound."""

    inferlets: int = 0
    tokens_per_minute: int = 0
    kv_pages: int = 0


class Quotas:
    """The bounds of each key (by owner: `auth.owner_of`) and what each key uses. `table` is
    `[serve.quotas]` (config.py checks its shape); `running(owner)` counts the owner's running
    inferlets (the runtime's); `clock` is the time in seconds."""

    def __init__(self, table: Mapping[str, Mapping[str, int]], running: Callable[[str | None], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        default = dict(table.get("default", {}))
        self.default = Quota(**default)
        self._quotas = {owner_of(key): Quota(**{**default, **bounds}) for key, bounds in table.items()
                        if key != "default"}
        self.running = running or (lambda owner: 0)
        self.clock = clock
        self._launching: Counter[str | None] = Counter()         # admitted, not yet running
        self._tokens: dict[str | None, deque[tuple[float, int]]] = {}
        self.refused: Counter[str] = Counter()                   # refusals by bound

    def of(self, owner: str | None) -> Quota:
        return self._quotas.get(owner, self.default)

    @contextmanager
    def launching(self, owner: str | None) -> Iterator[None]:
        """Around one launch of `owner`'s: refused (ApiError "rate_limited") when the owner runs
        its bound of inferlets or used its tokens of the minute; while it lasts, the launch counts
        against the bound (two launches at once cannot both take the last place)."""
        quota = self.of(owner)
        if quota.inferlets:
            running = self.running(owner) + self._launching[owner]
            if running >= quota.inferlets:
                self._refuse("inferlets", f"this key runs {running} inferlets, its bound: wait for one to end")
        if quota.tokens_per_minute:
            used = self.tokens_used(owner)
            if used >= quota.tokens_per_minute:
                self._refuse("tokens_per_minute", f"this key used {used} tokens in the last minute, its bound "
                                                  f"is {quota.tokens_per_minute}")
        self._launching[owner] += 1
        try:
            yield
        finally:
            self._launching[owner] -= 1
            if not self._launching[owner]:
                del self._launching[owner]

    def limits(self, owner: str | None, base: RunLimits) -> RunLimits:
        """The limits of a run of `owner`'s: `base`, with the owner's bounds of KV pages and of
        inferlets (which its children, `runtime.spawn`, count against)."""
        quota = self.of(owner)
        bounds = {k: v for k, v in (("kv_pages", quota.kv_pages), ("inferlets", quota.inferlets)) if v}
        return dataclasses.replace(base, **bounds) if bounds else base

    def used(self, owner: str | None, tokens: int) -> None:
        """`owner`'s request that just ended used `tokens`: an API request's usage (prompt and
        completion), a WebSocket process's Done.tokens (what the engine ran for it)."""
        if tokens > 0 and self.of(owner).tokens_per_minute:
            self._tokens.setdefault(owner, deque()).append((self.clock(), tokens))

    def tokens_used(self, owner: str | None) -> int:
        """The tokens of `owner`'s requests that ended in the last WINDOW_S seconds."""
        window = self._tokens.get(owner)
        if not window:
            return 0
        start = self.clock() - WINDOW_S
        while window and window[0][0] <= start:
            window.popleft()
        return sum(n for _, n in window)

    def _refuse(self, bound: str, message: str) -> None:
        self.refused[bound] += 1
        raise ApiError("rate_limited", f"quota exceeded ({bound}): {message}")
