"""Asyncio client of the engine's data-plane server (`pie_actors.gpu.engine.data_plane`), used by inferlet actors.

Calls are pipelined: each sends its request and awaits the response with its id, which a reader task
dispatches, so many passes are in flight on one connection. Every wire op (wire.py) has a typed
method: `async` ones await the reply; `start_pass` sends without awaiting and hands back the request
id and the reply's future; `start_free`, `repeat_ack` and `repeat_stop` send and drop the reply. The
client belongs to the event loop it was connected on; from another thread (the guest's), use
`asyncio.run_coroutine_threadsafe` (or `loop.call_soon_threadsafe` for the non-awaiting sends).

No torch here (it costs ~200 MB in every inferlet actor): only the protocol and msgpack.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Callable

from ..gpu.engine import wire

log = logging.getLogger(__name__)

_HIGH_WATER = 1 << 20   # unsent request bytes above which a call waits for the socket to drain


class EngineError(Exception):
    """An error response (`type` is the protocol's error type), or "ConnectionLost"."""

    def __init__(self, type: str, message: str):
        super().__init__(f"{type}: {message}")
        self.type, self.message = type, message


def _drop_outcome(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()     # retrieved, so asyncio does not log it as never retrieved


class EngineClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: tuple[str, int]):
        self.address = address
        self.requests = 0                 # requests sent (host -> engine round trips started)
        self.on_push: Callable[[dict], None] | None = None   # server pushes (subscribed channel values)
        self.on_lost: Callable[[str], None] | None = None    # the engine ended the connection: why (loop thread)
        self._reader, self._writer = reader, writer
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._lost: str | None = None   # why the connection ended
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, host: str, port: int, secret: bytes, owner: str | None = None,
                      kv_pages: int = 0, starting: bool = False,
                      on_lost: Callable[[str], None] | None = None) -> EngineClient:
        """Connect and prove the engine's `secret` (the handshake in wire.py) for a program of
        `owner`, whose working sets may hold `kv_pages` pages together (0: no bound); `starting`:
        the program is being launched and its first pass is to come (the engine gathers first
        passes for it). `on_lost(reason)` is called once if the engine's side ends the connection
        (set here, so no loss goes unseen). `EngineClient.connect(*address)` takes a
        `wire.EngineAddress`. A refused proof is an EngineError("Unauthorized")."""
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await cls.handshake(reader, writer, secret, owner, kv_pages, starting)
        except BaseException:
            writer.close()
            raise
        client = cls(reader, writer, (host, port))
        client.on_lost = on_lost           # before its reader task first runs
        return client

    @staticmethod
    async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                        owner: str | None = None, kv_pages: int = 0, starting: bool = False) -> None:
        """Answer the server's hello with the proof of `secret` and wait for its "ready"."""
        hello = wire.unpack(await wire.read_frame(reader, wire.MAX_AUTH_FRAME))
        nonce = hello.get("hello") if isinstance(hello, dict) else None
        if not isinstance(nonce, bytes):
            raise EngineError("Unauthorized", "the server did not open with a data-plane hello")
        writer.write(wire.pack({"auth": wire.proof(secret, nonce), "owner": owner, "kv_pages": kv_pages,
                                "starting": starting}))
        answer = wire.unpack(await wire.read_frame(reader, wire.MAX_AUTH_FRAME))
        if "error" in answer:
            raise EngineError(answer["error"]["type"], answer["error"]["message"])

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def start(self, op: str, **fields: Any) -> tuple[int, asyncio.Future]:
        """Send one request now (no await: requests go out in call order); returns its id and the
        future of its result."""
        if self._lost is not None:
            raise self._connection_lost()
        id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[id] = future
        self._writer.write(wire.pack(wire.request(id, op, **fields)))
        self.requests += 1
        return id, future

    async def call(self, op: str, **fields: Any) -> Any:
        """Send one request and return its result; raises EngineError for an error response."""
        _, future = self.start(op, **fields)
        if self._writer.transport.get_write_buffer_size() > _HIGH_WATER:
            try:
                await self._writer.drain()
            except ConnectionError:
                pass   # the reader task fails this call's future with the reason
        return await future

    async def info(self) -> wire.Info:
        return await self.call("info")

    async def create(self) -> int:
        """A new empty sequence (working set), owned by this connection."""
        return await self.call("create")

    async def fork(self, seq: int) -> int:
        """A child sequence sharing `seq`'s frozen prefix."""
        return await self.call("fork", seq=seq)

    async def free(self, seq: int) -> None:
        await self.call("free", seq=seq)

    def start_free(self, seq: int) -> None:
        """Free `seq` without waiting: written after every request sent before it."""
        self._send_only("free", seq=seq)

    async def state(self, seq: int) -> wire.SeqState:
        return await self.call("seq_state", seq=seq)

    async def reserve(self, seq: int, end: int) -> None:
        """Pages for `seq`'s local slots [0, end), for passes with explicit slots."""
        await self.call("reserve", seq=seq, end=end)

    async def save(self, seq: int, name: str, owner: str | None) -> int:
        """Keep `seq`'s frozen prefix as `owner`'s saved set `name`; returns its number of tokens."""
        return await self.call("save", seq=seq, name=name, owner=owner)

    async def open(self, name: str, owner: str | None) -> wire.Opened:
        """A new sequence (owned by this connection) holding `owner`'s saved set `name`."""
        return await self.call("open", name=name, owner=owner)

    async def saved(self, owner: str | None) -> list[wire.SavedSet]:
        return await self.call("saved", owner=owner)

    async def delete_saved(self, name: str, owner: str | None) -> None:
        await self.call("delete_saved", name=name, owner=owner)

    async def forward(self, lanes: list[wire.LaneSpec], epilogue: dict[str, Any] = wire.ARGMAX) -> Any:
        """Run one forward pass; returns its epilogue's output ("argmax": one token per readout row;
        "logits": a float32 memoryview of shape [readout rows, vocab])."""
        return await self.call("pass", lanes=lanes, epilogue=epilogue)

    def start_pass(self, lanes: list[wire.LaneSpec], epilogue: dict[str, Any] = wire.ARGMAX, *,
                   prologue: int | None = None, adapters: list[list] | None = None,
                   repeat: dict[str, int] | None = None) -> tuple[int, asyncio.Future]:
        """Send a forward pass now, without awaiting it (passes go out in call order); returns its
        request id (what `repeat_ack` / `repeat_stop` name) and the future of its result. `repeat`
        {"budget", "window"} makes it a repeating pass, whose result is the number of runs kept."""
        optional = {"prologue": prologue, "adapters": adapters, "repeat": repeat}
        return self.start("pass", lanes=lanes, epilogue=epilogue,
                          **{k: v for k, v in optional.items() if v is not None})

    def idle(self) -> None:
        """Tell the engine this program now waits on something else: its next batch need not
        wait for this connection's next pass."""
        self._send_only("idle")

    def park(self) -> None:
        """The program waits for a message with no pass in flight: its working sets may leave the
        KV pool first when it runs short; its next request on one brings them back."""
        self._send_only("park")

    def repeat_ack(self, pass_id: int, read: int) -> None:
        """The outputs of `read` runs of repeating pass `pass_id` were read: it may run further ahead."""
        self._send_only("repeat_ack", **{"pass": pass_id, "read": read})

    def repeat_stop(self, pass_id: int, keep: int | None = None) -> None:
        """Stop repeating pass `pass_id`; the runs after the first `keep` are cut off its sequences."""
        self._send_only("repeat_stop", **{"pass": pass_id, "keep": keep})

    async def program(self, ir: str) -> int:
        """Register (and compile, once per engine) an eta program; returns its id here."""
        return await self.call("program", ir=ir)

    async def stats(self) -> wire.Stats:
        return await self.call("stats")

    async def usage(self) -> int:
        """The input rows (tokens, prefix-cache hits not among them) the engine ran for this
        connection's passes so far."""
        return await self.call("usage")

    async def chan_create(self, shape: list[int], dtype: str, capacity: int = 1, values: Any = None) -> int:
        """A new channel (owned by this connection), holding `values` when given; returns its id."""
        return await self.call("chan_create", shape=shape, dtype=dtype, capacity=capacity, values=values)

    async def chan_put(self, chan: int, value: Any) -> None:
        await self.call("chan_put", chan=chan, value=value)

    async def chan_put_bits(self, chan: int, words: list[int], n: int) -> None:
        """Put a bool value of `n` elements packed in int32 words (element i: bit i % 32 of word i // 32)."""
        await self.call("chan_put", chan=chan, value=words, bits=n)

    async def chan_take(self, chan: int) -> Any:
        """The channel's next value; an error response when it is empty."""
        return await self.call("chan_take", chan=chan)

    async def chan_subscribe(self, chan: int) -> None:
        """From now on every value put into `chan` is pushed to `on_push` instead of waiting for a take."""
        await self.call("chan_subscribe", chan=chan)

    async def chan_free(self, chan: int) -> None:
        await self.call("chan_free", chan=chan)

    def _send_only(self, op: str, **fields: Any) -> None:
        """Send a request whose reply nobody awaits. Its failure is dropped, a lost connection too:
        what these requests are about (a sequence, a repeating pass) ends with the connection."""
        try:
            _, future = self.start(op, **fields)
        except EngineError:
            return
        future.add_done_callback(_drop_outcome)

    async def close(self) -> None:
        """Close the connection; the engine frees every sequence this connection still owns."""
        if self._lost is None:
            self._lost = "was closed by the client"
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass
        self._reader_task.cancel()
        await asyncio.gather(self._reader_task, return_exceptions=True)

    @property
    def lost_engine(self) -> bool:
        """Whether the connection ended from the engine's side (it closed, reset or died)."""
        return self._lost is not None and self._lost != "was closed by the client"

    @property
    def lost_reason(self) -> str:
        """Why the connection ended, as the calls it fails say it."""
        host, port = self.address
        return f"the engine connection was lost: the connection to the engine at {host}:{port} {self._lost}"

    def _connection_lost(self) -> EngineError:
        return EngineError("ConnectionLost", self.lost_reason)

    async def _read_loop(self) -> None:
        try:
            while True:
                message = wire.unpack(await wire.read_frame(self._reader))
                if "push" in message:
                    if self.on_push is not None:
                        try:
                            self.on_push(message)
                        except Exception:     # a consumer's bug must not end the connection
                            log.exception("engine push handler failed on %r", message.get("push"))
                    continue
                future = self._pending.pop(message.get("id"), None)
                if future is None:
                    # id None: the server could not read one of our frames (a client bug); the call
                    # it belonged to cannot be told apart, so say so loudly.
                    log.error("engine response matches no pending call: %r", message)
                elif future.done():
                    pass   # the caller stopped waiting (cancelled)
                elif "error" in message:
                    future.set_exception(EngineError(message["error"]["type"], message["error"]["message"]))
                else:
                    future.set_result(message["result"])
        except asyncio.IncompleteReadError:
            self._lost = self._lost or "was closed by the engine"
        except asyncio.CancelledError:
            pass
        except Exception as e:   # a reset, or a frame we cannot read: the stream is not usable
            self._lost = self._lost or f"failed: {type(e).__name__}: {e}"
        finally:
            self._lost = self._lost or "was closed"
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(self._connection_lost())
            self._pending.clear()
            self._writer.close()
            if self.lost_engine and self.on_lost is not None:
                try:
                    self.on_lost(self.lost_reason)
                except Exception:     # a consumer's bug must not hide the loss from the others
                    log.exception("engine connection-lost handler failed")
