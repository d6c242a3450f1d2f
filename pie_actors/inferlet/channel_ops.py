"""The `chan.*` host operations (`ChannelOps`): channels between the guest and its passes.

A channel's handle is the run's own small integer, mapped to the engine's channel id (None until
the engine is chosen: engine_link.py). A channel the guest reads with `take_scalar` is
subscribed: the engine pushes every value put into it (`on_push`), so reading a token costs no
request, and the guest is handed every value there at once. A run-ahead (run_ahead_ops.py) may
hold a channel's readers until several values are there (`hold`).
"""
from __future__ import annotations

import itertools
from typing import Any, Awaitable, Callable

from typing_extensions import NotRequired, TypedDict

from .engine_client import EngineClient
from .engine_link import EngineLink
from .host import HostOpError, Inbox
from .host_op import Handle, host_op, shape

__all__ = ["ChannelOps"]


@shape
class Create(TypedDict):
    shape: list[int]
    dtype: str
    capacity: NotRequired[int]
    values: NotRequired[Any]       # its initial values (a nested list), or null


@shape
class Put(TypedDict):
    handle: int
    value: Any


@shape
class PutBits(TypedDict):
    handle: int
    words: list[int]
    n: int


class ChannelOps:
    interface = "channels"

    def __init__(self, link: EngineLink) -> None:
        self.link, self.run = link, link.run
        self._chan: dict[int, int | None] = {}            # channel handle -> engine channel id
        self._chan_ids = itertools.count(1)
        self._channels: dict[int, Inbox] = {}             # subscribed engine channel -> the values pushed
        self._held: dict[int, int] = {}                  # engine channel -> values its reads wait for
        self.run.on_push = self._on_push
        self.run.on_lost.append(self._engine_lost)

    def _known_chan(self, handle: int) -> int | None:
        """The engine id of channel `handle`, None while it waits for the engine to be chosen."""
        if handle not in self._chan:
            raise HostOpError(f"channel {handle!r} does not exist (never created by this run, or freed)")
        return self._chan[handle]

    def engine_chan(self, handle: int) -> int:
        """The engine's id of channel `handle` (one made before the engine was chosen makes the
        choice now)."""
        self._known_chan(handle)
        return self.link.engine_id(self._chan, handle, "channel")

    def handles(self, cids: set[int]) -> list[int]:
        """The run's handles of engine channels `cids`."""
        return [h for h, cid in self._chan.items() if cid in cids]

    @host_op("chan.create", Create)
    def create(self, shape: list[int], dtype: str, capacity: int = 1, values: Any = None) -> int:
        handle = next(self._chan_ids)
        self._chan[handle] = None

        async def create(client: EngineClient) -> None:
            if handle in self._chan:                       # not freed meanwhile
                self._chan[handle] = await client.chan_create(shape, dtype, capacity, values)
        try:
            self.link.now_or_later(create)
        except HostOpError:
            del self._chan[handle]
            raise
        return handle

    @host_op("chan.put", Put, wire="list")
    def put(self, handle: int, value: Any) -> None:
        self._put(handle, lambda client, cid: client.chan_put(cid, value))

    @host_op("chan.put_bits", PutBits, wire="list")
    def put_bits(self, handle: int, words: list[int], n: int) -> None:
        """A bool value sent as packed int32 words (bit i % 32 of word i // 32 = element i)."""
        self._put(handle, lambda client, cid: client.chan_put_bits(cid, words, n))

    def _put(self, handle: int, put: Callable[[EngineClient, int], Awaitable[None]]) -> None:
        if self._known_chan(handle) in self._channels:
            raise HostOpError(f"channel {handle} is read by the host (take_scalar); the host cannot put into it")

        async def step(client: EngineClient) -> None:
            if handle in self._chan:                       # not freed meanwhile
                await put(client, self.engine_chan(handle))
        self.link.now_or_later(step)

    @host_op("chan.take", Handle)
    def take(self, handle: int) -> Any:
        cid = self.engine_chan(handle)
        inbox = self._channels.get(cid)
        if inbox is None:
            return self.run.wait(self.run.client.chan_take(cid))
        try:
            return inbox.take()
        except LookupError:
            raise HostOpError(f"channel {handle} is empty (await take_scalar() waits for a value)") from None

    @host_op("chan.take_scalar", Handle)
    def take_scalar(self, handle: int) -> dict[str, Any]:
        """{"values": [...]}, every value of the channel that has arrived, when one has; else
        {"future": id} of the values that arrive next (a run-ahead's `wake_every` of them). The
        channel is subscribed on first use. The guest keeps what it is handed and reads on from it
        (the SDK's `Channel.take_scalar`), so a run-ahead loop makes a host call a burst of tokens,
        not one a token."""
        inbox = self._channels.get(self._chan.get(handle))
        if inbox is not None:
            try:
                return {"values": inbox.take(every=True)}
            except LookupError:
                return {"future": inbox.receive(every=True)}
        cid = self.engine_chan(handle)
        inbox = self._channels[cid] = Inbox(self.run.futures)
        inbox.hold(self._held.get(cid, 1))
        fid = inbox.receive(every=True)
        try:
            self.run.wait(self.run.client.chan_subscribe(cid))
        except HostOpError:
            del self._channels[cid]
            raise
        return {"future": fid}

    def _on_push(self, message: dict) -> None:
        """An engine push (loop thread): a value put into a subscribed channel, or its poisoning."""
        inbox = self._channels.get(message.get("chan"))
        if inbox is None:
            return
        if "error" in message:
            inbox.fail(f"the channel is poisoned by a failed pass: {message['error']}")
        else:
            inbox.put(message.get("value"))

    def _engine_lost(self, reason: str) -> None:
        """The engine connection ended (loop thread): no value comes any more to a subscribed channel."""
        for inbox in list(self._channels.values()):
            inbox.fail(reason)

    @host_op("chan.free", Handle)
    def free(self, handle: int) -> None:
        cid = self._known_chan(handle)
        del self._chan[handle]
        if cid is not None:
            self._channels.pop(cid, None)
            self.run.wait(self.run.client.chan_free(cid))

    # ---- what a run-ahead does to the channels its epilogue puts into ------------------------

    def hold(self, cids: set[int], wake: int) -> None:
        """Reads of these channels that would wait wait for `wake` values (or the run-ahead's end)."""
        for cid in cids:
            self._held[cid] = wake
            if cid in self._channels:
                self._channels[cid].hold(wake)

    def unhold(self, cids: set[int]) -> None:
        """No more values come: what is there is all."""
        for cid in cids:
            if self._held.pop(cid, None) is not None and cid in self._channels:
                self._channels[cid].hold(1)

    def clear(self, cids: set[int]) -> None:
        """Drop what the guest has not read of these channels."""
        for cid in cids:
            if cid in self._channels:
                self._channels[cid].clear()
