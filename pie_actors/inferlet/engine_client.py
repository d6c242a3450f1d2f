"""Asyncio client of the engine's data-plane server (`pie_actors.gpu.engine.data_plane`), used by inferlet actors.

Calls are pipelined: each sends its request and awaits the response with its id, which a reader task
dispatches, so many passes are in flight on one connection. The client belongs to the event loop it
was connected on; from another thread (the guest's), use `asyncio.run_coroutine_threadsafe`.

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


class EngineClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: tuple[str, int]):
        self.address = address
        self.requests = 0                 # requests sent (host -> engine round trips started)
        self.on_push: Callable[[dict], None] | None = None   # server pushes (subscribed channel values)
        self._reader, self._writer = reader, writer
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._lost: str | None = None   # why the connection ended
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, host: str, port: int) -> EngineClient:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, (host, port))

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

    async def state(self, seq: int) -> wire.SeqState:
        return await self.call("seq_state", seq=seq)

    async def reserve(self, seq: int, end: int) -> None:
        """Pages for `seq`'s local slots [0, end), for passes with explicit slots."""
        await self.call("reserve", seq=seq, end=end)

    async def forward(self, lanes: list[wire.LaneSpec], epilogue: dict[str, Any] = wire.ARGMAX) -> Any:
        """Run one forward pass; returns its epilogue's output ("argmax": one token per readout row;
        "logits": a float32 memoryview of shape [readout rows, vocab])."""
        return await self.call("pass", lanes=lanes, epilogue=epilogue)

    async def program(self, ir: str) -> int:
        """Register (and compile, once per engine) an eta program; returns its id here."""
        return await self.call("program", ir=ir)

    async def stats(self) -> wire.Stats:
        return await self.call("stats")

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

    def _connection_lost(self) -> EngineError:
        host, port = self.address
        return EngineError("ConnectionLost", f"the connection to the engine at {host}:{port} {self._lost}")

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
