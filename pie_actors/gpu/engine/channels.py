"""Channels: typed queues of tensors in the engine's device memory.

A channel holds values of one element shape and dtype, up to its capacity. The host puts and takes
values through the data plane; epilogues put and take them on the device (eta `put`/`take`); a pass
can take its input tokens from one (device -> device: an epilogue feeds the next pass without a
host round trip).

A channel the host reads (`subscribe`) becomes device -> host: every value put into it from then on
is handed to the subscriber (the connection pushes it to the inferlet host) instead of being queued,
so reading a token costs no request. A failed pass *poisons* the channels it uses: their takes and
puts fail with the pass's error, and a subscriber is told, so a host waiting on one sees the error.
"""
from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...config import EngineConfig
from ..eta import DTYPES

__all__ = ["ChannelError", "ChannelStore", "MAX_CAPACITY", "MAX_ELEMENTS"]

MAX_CAPACITY = 4096          # values a channel may buffer
MAX_ELEMENTS = 1 << 20       # elements of one channel value (a vocabulary mask fits)

# (channel, value as a list, poison message); called under the store's lock at times, so it only hands over
Sink = Callable[[int, "list | None", "str | None"], None]


class ChannelError(ValueError):
    """A channel operation that cannot be done: unknown channel, empty, full, poisoned, bad value."""


@dataclass
class _Channel:
    shape: tuple[int, ...]
    dtype: torch.dtype
    capacity: int
    nbytes: int                 # what it holds when full: reserved from the budget at creation
    values: deque = field(default_factory=deque)
    poisoned: str | None = None
    sink: Sink | None = None


class ChannelStore:
    """All channels of an engine; thread-safe (the engine thread runs epilogues, the server's loop
    serves host requests)."""

    def __init__(self, device: torch.device | str = "cpu",
                 memory_budget: int = EngineConfig.channel_memory_mb << 20) -> None:
        self.device = torch.device(device)
        self.memory_budget = memory_budget
        self.reserved = 0                       # bytes of the budget the live channels hold
        self._channels: dict[int, _Channel] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def create(self, shape: list[int], dtype: str, capacity: int = 1, values: Any = None) -> int:
        """A new channel of `dtype` elements of `shape`; `values`, when given, is its first value."""
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ChannelError(f"a channel shape is a list of non-negative integers, got {shape!r:.60}")
        if math.prod(shape) > MAX_ELEMENTS:
            raise ChannelError(f"channel values of shape {shape} exceed {MAX_ELEMENTS} elements")
        if dtype not in DTYPES:
            raise ChannelError(f"unknown channel dtype {dtype!r} (one of {', '.join(DTYPES)})")
        if type(capacity) is not int or not 1 <= capacity <= MAX_CAPACITY:
            raise ChannelError(f"channel capacity must be in [1, {MAX_CAPACITY}], got {capacity!r}")
        nbytes = capacity * math.prod(shape) * DTYPES[dtype].itemsize
        chan = _Channel(tuple(shape), DTYPES[dtype], capacity, nbytes)
        if values is not None:
            chan.values.append(self._value(chan, values))
        with self._lock:
            if self.reserved + nbytes > self.memory_budget:
                raise ChannelError(f"a channel of {capacity} x {shape} {dtype} needs {nbytes} bytes; the "
                                   f"engine's channels have {self.memory_budget - self.reserved} of "
                                   f"{self.memory_budget} left (free channels, or ask for less capacity)")
            self.reserved += nbytes
            cid = next(self._ids)
            self._channels[cid] = chan
        return cid

    def _get(self, cid: int) -> _Channel:
        chan = self._channels.get(cid)
        if chan is None:
            raise ChannelError(f"channel {cid} does not exist (never created, or freed)")
        if chan.poisoned is not None:
            raise ChannelError(f"channel {cid} is poisoned by a failed pass: {chan.poisoned}")
        return chan

    def _value(self, chan: _Channel, value: Any) -> torch.Tensor:
        try:
            tensor = torch.as_tensor(value, device=self.device).to(chan.dtype)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ChannelError(f"cannot make a channel value from {value!r:.60}: {e}") from None
        if tuple(tensor.shape) != chan.shape:
            if tensor.numel() != math.prod(chan.shape):
                raise ChannelError(f"a value of shape {list(tensor.shape)} does not fit a channel of "
                                   f"shape {list(chan.shape)}")
            tensor = tensor.reshape(chan.shape)
        return tensor

    def put(self, cid: int, value: Any) -> None:
        """Enqueue `value` (a tensor, a number or a nested list), or hand it to the subscriber."""
        with self._lock:
            chan = self._get(cid)
            tensor = self._value(chan, value)
            sink = chan.sink
            if sink is None:
                if len(chan.values) >= chan.capacity:
                    raise ChannelError(f"channel {cid} is full ({chan.capacity} values; raise it "
                                       "with .capacity(n))")
                chan.values.append(tensor.clone())
                return
        sink(cid, tensor.tolist(), None)

    def put_rows(self, cids: list[int], values: torch.Tensor) -> list[ChannelError | None]:
        """Put row i of `values` into channel `cids[i]`, for many channels at once: one conversion
        and copy of the rows a dtype, one lock, and no tensor work a channel (an epilogue run for
        many passes puts this way; a queued row is a view of that copy, which lives until every
        channel has let go of its row). The error of a channel that cannot take its row stands in
        its place; the other rows are put."""
        errors: list[ChannelError | None] = [None] * len(cids)
        converted: dict[torch.dtype, torch.Tensor] = {}    # a copy: the rows may be a program's constant
        listed: dict[torch.dtype, list] = {}
        sends = []
        with self._lock:
            for i, cid in enumerate(cids):
                try:
                    chan = self._get(cid)
                    if chan.dtype not in converted:
                        converted[chan.dtype] = values.to(self.device, chan.dtype, copy=True)
                    rows = converted[chan.dtype]
                    fits = tuple(rows.shape[1:]) == chan.shape
                    row = rows[i] if fits else self._value(chan, rows[i])   # a reshape, or its error
                    if chan.sink is not None:
                        if fits and chan.dtype not in listed:
                            listed[chan.dtype] = rows.tolist()
                        sends.append((chan.sink, cid, listed[chan.dtype][i] if fits else row.tolist()))
                    elif len(chan.values) >= chan.capacity:
                        raise ChannelError(f"channel {cid} is full ({chan.capacity} values; raise it "
                                           "with .capacity(n))")
                    else:
                        chan.values.append(row)
                except ChannelError as e:
                    errors[i] = e
        for sink, cid, value in sends:
            sink(cid, value, None)
        return errors

    def put_bits(self, cid: int, words: list[int], n: int) -> None:
        """Enqueue a bool value of `n` elements sent as packed int32 words (bit i % 32 of word
        i // 32 = element i): 1 number per 32 tokens of a vocabulary mask."""
        if not 0 <= n <= 32 * len(words) or len(words) > MAX_ELEMENTS:
            raise ChannelError(f"{len(words)} words cannot hold {n} bits")
        packed = torch.tensor(words, dtype=torch.int64, device=self.device)
        shifts = torch.arange(32, dtype=torch.int64, device=self.device)
        self.put(cid, ((packed[:, None] >> shifts) & 1).reshape(-1)[:n].bool())

    def take(self, cid: int) -> torch.Tensor:
        """Dequeue the oldest value; ChannelError when the channel is empty."""
        with self._lock:
            chan = self._get(cid)
            if not chan.values:
                raise ChannelError(f"channel {cid} is empty"
                                   + (" (the host reads it: values put into it go to the host)"
                                      if chan.sink is not None else ""))
            return chan.values.popleft()

    def snapshot(self, cids: list[int]) -> dict[int, list[torch.Tensor]]:
        """The queued values of the channels the device reads (not subscribed ones), to restore."""
        with self._lock:
            return {cid: list(chan.values) for cid in cids
                    if (chan := self._channels.get(cid)) is not None and chan.sink is None}

    def restore(self, snapshot: dict[int, list[torch.Tensor]]) -> None:
        """Put channels back to a snapshot (values are never changed in place, so sharing is safe)."""
        with self._lock:
            for cid, values in snapshot.items():
                chan = self._channels.get(cid)
                if chan is not None and chan.poisoned is None:
                    chan.values = deque(values)

    def subscribe(self, cid: int, sink: Sink) -> None:
        """From now on values put into `cid` go to `sink` (queued ones first)."""
        with self._lock:
            chan = self._get(cid)
            if chan.sink is not None:
                raise ChannelError(f"channel {cid} is already read by the host")
            chan.sink = sink
            # handed over under the lock: a put on the engine thread that sees the sink comes after
            for value in chan.values:
                sink(cid, value.tolist(), None)
            chan.values.clear()

    def poison(self, cids: list[int], message: str) -> None:
        """Mark channels unusable after a failed pass; their subscribers hear of it."""
        sinks = []
        with self._lock:
            for cid in cids:
                chan = self._channels.get(cid)
                if chan is not None and chan.poisoned is None:
                    chan.poisoned = message
                    chan.values.clear()
                    if chan.sink is not None:
                        sinks.append((chan.sink, cid))
        for sink, cid in sinks:
            sink(cid, None, message)

    def free(self, cid: int) -> None:
        with self._lock:
            chan = self._channels.pop(cid, None)
            if chan is not None:
                self.reserved -= chan.nbytes

    def __len__(self) -> int:
        return len(self._channels)
