"""The engine's data-plane server: the wire protocol (`pie_actors.gpu.engine.wire`) over TCP, served by asyncio.

Per-pass traffic must not be a Ray method call (~0.8 ms each here; a socket round trip is ~50 µs), so
inferlets reach the engine through this server. Each pass request goes to `Engine.submit`, and its
future is bridged back to the event loop, so any number of passes can be in flight per connection.

A connection first proves the engine's secret (the handshake in wire.py); one that does not is
refused, with an error frame and counted in the stats, before any request of it is read. It
names the owner of the program it serves, and the working sets it creates live in that owner's
prefix-cache partition, keyed by the secret.

A connection owns the sequences it creates or forks. When it closes, however the inferlet ended
(returned, raised, trapped, was killed), the server frees every sequence it still owns: that is
what returns all of an inferlet's KV pages. Bad input fails its request only, never the connection.

A connection whose program waits for a message with no pass in flight parks (`park`): its working
sets are the first to leave the KV pool when it runs short (saved.py). They come back at its next
request that uses one: a pass is queued behind their prefill, and any other such request is
answered once they are all back.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, NamedTuple

from . import wire
from ...config import EngineConfig
from ...event_loop import new_event_loop
from ...kvstore import KVStoreError, UnknownSequence, partition_root
from ..model.adapters import parse_site
from .channels import ChannelError
from .engine import Engine
from .scheduler import Epilogue, Lane, PassError, PassRequest, Repeat, RowEpilogue
from .epilogues import (ROWS_EPILOGUES, SIMPLE, SIMPLE_EPILOGUES, EpilogueError, adapter_fn, lanes_program_epilogue,
                        program_epilogue, prologue_runner)
from ..eta import EtaError, Program

log = logging.getLogger(__name__)

_HIGH_WATER = 1 << 20   # unsent response bytes above which a connection stops reading requests
HANDSHAKE_TIMEOUT_S = 10.0   # a connection that has not proved the secret by then is refused


class BadRequest(ValueError):
    """A request whose shape or field types are wrong."""


def _epilogue_kind(spec: Any) -> str:
    kinds = [*SIMPLE, "program"]
    if not isinstance(spec, dict) or spec.get("kind") not in kinds:
        raise BadRequest(f"epilogue must be a map with 'kind' one of {kinds}, got {spec!r:.80}")
    return spec["kind"]


# ---- wire input validation ---------------------------------------------------------------------------

# The checkers name the field as the concatenation of `what`: formatted only for the error message,
# since every pass's every lane goes through them.

def _int(value: Any, *what: str) -> int:
    if type(value) is not int:   # bool is an int subclass: refuse it too
        raise BadRequest(f"{''.join(what)} must be an integer, got {value!r:.40}")
    return value


def _ints(value: Any, *what: str) -> list[int]:
    if not isinstance(value, list) or any(type(v) is not int for v in value):
        raise BadRequest(f"{''.join(what)} must be a list of integers, got {value!r:.60}")
    return value


def _mask(value: Any, *what: str) -> list[list[bool]]:
    if not isinstance(value, list) or not all(isinstance(r, list) and all(type(b) is bool for b in r)
                                              for r in value):
        raise BadRequest(f"{''.join(what)} must be a list of lists of booleans")
    return value


def _name(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise BadRequest(f"a saved working set's name is a string of 1 to 256 characters, got {value!r:.40}")
    return value


def _optional(check: Callable[..., Any], value: Any, *what: str) -> Any:
    return None if value is None else check(value, *what)


_LANE_FIELDS = {"seq", "tokens", "positions", "slots", "kv_len", "mask", "fold", "readout", "checkpoints",
                "tokens_from"}
_KNOWN_ERRORS = (BadRequest, EpilogueError, PassError, KVStoreError, ChannelError, EtaError)


class EngineServer:
    """Serves a started `Engine` (`engine.start()`) on a TCP port from its own event-loop thread, to
    the connections that prove `secret` (made here: 32 random bytes)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.secret = secrets.token_bytes(32)
        cfg = engine.model_config
        self.info: wire.Info = {
            "model": engine.model_name, "model_dir": str(engine.model_dir), "architecture": cfg.architecture,
            "dtype": str(engine.worker.dtype).removeprefix("torch."), "device": str(engine.worker.device),
            "vocab_size": cfg.vocab_size, "page_size": engine.kv.page_size,
            "max_position": cfg.max_position_embeddings,
            "eos_ids": list(engine.tokenizer.eos_ids if engine.tokenizer else cfg.eos_token_ids)}
        self.address: wire.EngineAddress | None = None
        self.requests = 0                          # frames received, all connections together
        self.refused = 0                           # connections that failed the handshake
        self._ids = itertools.count(1)             # connection ids: the owners of their passes
        self._connections: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str = "127.0.0.1", port: int = 0) -> wire.EngineAddress:
        """Listen on host:port (0: any free port); returns the bound address with the secret."""
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(host, port, ready), name="engine-server",
                                        daemon=True)
        self._thread.start()
        self.address = wire.EngineAddress(*ready.result(), self.secret)
        return self.address

    def close(self) -> None:
        """Stop serving; open connections close and their sequences are freed."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None

    def stats(self) -> wire.Stats:
        kv = self.engine.kv_stats()
        # dict() of a Counter copies in C under the GIL: safe while the engine thread increments it
        programs = self.engine.programs
        return {"batch_sizes": dict(self.engine.batch_sizes), "kv": kv, "states": self.engine.state_stats(),
                "saved": self.engine.saved_stats(), "parked": self.engine.parked_stats(),
                "decode_batch_sizes": dict(self.engine.decode_batch_sizes),
                "tokens_computed": self.engine.tokens_computed,
                "row_epilogues": dict(self.engine.row_epilogues),
                "step_seconds": dict(self.engine.step_seconds),
                "hold": self.engine.scheduler.arrivals.stats(),
                "programs": {"compiled": programs.misses, "cache_hits": programs.hits},
                "compile": self.engine.compile_progress(),
                "channels": len(self.engine.channels), "requests": self.requests,
                "connections": len(self._connections), "refused": self.refused,
                "sequences": sum(len(c.owned) for c in list(self._connections))}

    def _run(self, host: str, port: int, ready: Future) -> None:
        loop = self._loop = new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(asyncio.start_server(self._serve, host, port))
        except BaseException as e:
            ready.set_exception(e)
            loop.close()
            return
        ready.set_result(tuple(server.sockets[0].getsockname()[:2]))
        loop.run_forever()
        server.close()
        tasks = [c.task for c in self._connections]
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                         ) -> tuple[str | None, int, bool] | None:
        """The owner, partition root and `starting` flag of a connection that proves the secret
        (wire.py; the caller says "ready"); None, after an Unauthorized error frame, for one that
        does not."""
        nonce = secrets.token_bytes(wire.NONCE_BYTES)
        writer.write(wire.pack({"hello": nonce}))
        why = "the connection did not prove the engine's secret: the handshake answers the hello with its HMAC"
        try:
            body = await asyncio.wait_for(wire.read_frame(reader, wire.MAX_AUTH_FRAME), HANDSHAKE_TIMEOUT_S)
            answer = wire.unpack(body)
        except TimeoutError:
            answer, why = None, f"the connection did not answer the hello within {HANDSHAKE_TIMEOUT_S:g} s"
        except Exception:                       # gone, too large, not msgpack: no proof
            answer = None
        if not isinstance(answer, dict):
            answer = {}
        owner, pages, starting = answer.get("owner"), answer.get("kv_pages", 0), answer.get("starting", False)
        if not wire.proves(self.secret, nonce, answer) or not (owner is None or isinstance(owner, str)) \
                or type(pages) is not int or pages < 0 or type(starting) is not bool:
            self.refused += 1
            writer.write(wire.pack(wire.error(None, "Unauthorized", why)))
            return None
        partition = partition_root(self.secret, owner)
        self.engine.limit_pages(partition, pages)
        return owner, partition, starting

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted = await self._handshake(reader, writer)
        if accepted is None:
            writer.close()
            return
        owner, partition, starting = accepted
        conn = _Connection(self, writer, owner, partition)
        self._connections.add(conn)
        if starting:
            self.engine.connected(conn.id)
        writer.write(wire.pack(wire.reply(None, "ready")))     # the client's requests follow this
        try:
            while True:
                try:
                    body = await wire.read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except wire.FrameTooLarge as e:
                    conn.send(wire.error(None, "BadFrame", str(e)))
                    return
                self.requests += 1
                conn.handle(body)
                if writer.transport.get_write_buffer_size() > _HIGH_WATER:
                    try:
                        await writer.drain()
                    except ConnectionError:
                        return
        except asyncio.CancelledError:
            pass        # the server closes; a cancelled task makes Python 3.11's start_server print a traceback
        finally:
            conn.release()          # before it stops counting: no connection open means nothing of theirs is held
            self._connections.discard(conn)
            writer.close()


_PENDING = object()   # a handler's result when the reply comes later (a pass in the engine)


class _Connection:
    """One client, for the programs of `owner`: dispatches its requests and owns the sequences it
    created, which it makes in the owner's prefix-cache `partition` (a root key)."""

    def __init__(self, server: EngineServer, writer: asyncio.StreamWriter, owner: str | None, partition: int):
        self.engine = server.engine
        self.owner, self.partition = owner, partition
        self.server = server
        self.writer = writer
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.id = next(server._ids)
        self.owned: set[int] = set()                  # sequences
        self.channels: set[int] = set()
        self.programs: list[Program] = []             # registered eta programs, by id
        self._made: dict[tuple[int, tuple[int, ...]], tuple[Epilogue, RowEpilogue | None]] = {}
        self.repeats: dict[int, PassRequest] = {}     # pass request id -> its repeating pass
        self.parked = False                           # its sets may be out of the pool (`park`)

    def send(self, message: dict[str, Any]) -> None:
        if not self.writer.is_closing():
            self.writer.write(wire.pack(message))

    def handle(self, body: bytes) -> None:
        try:
            msg = wire.unpack(body)
        except Exception as e:    # msgpack raises several unrelated types for bad input
            self.send(wire.error(None, "BadFrame", f"frame is not a msgpack message: {e}"))
            return
        id = msg.get("id") if isinstance(msg, dict) else None
        if type(id) is not int:
            self.send(wire.error(None, "BadRequest", "a request is a map with an integer 'id' and an 'op'"))
            return
        self._answer(id, msg)

    def _answer(self, id: int, msg: dict[str, Any]) -> None:
        try:
            result = self._dispatch(msg)
        except Exception as e:
            if not isinstance(e, _KNOWN_ERRORS):
                log.exception("request %r failed", msg.get("op"))
            self.send(wire.error(id, type(e).__name__, str(e)))
            return
        if result is not _PENDING:
            self.send(wire.reply(id, result))

    def _dispatch(self, msg: dict[str, Any]) -> Any:
        op = msg.get("op")
        spec = _OPS.get(op) if isinstance(op, str) else None
        if spec is None:
            raise BadRequest(f"unknown op {op!r}; known: {list(_OPS)}")
        extra = set(msg) - {"id", "op", *spec.required, *spec.optional}
        missing = [f for f in spec.required if f not in msg]
        if extra or missing:
            raise BadRequest(f"{op}: fields {list(spec.required)} (optional {list(spec.optional)}) expected; "
                             f"missing {missing}, unknown {sorted(extra)}")
        if self.parked and spec.uses_sets:
            prefill = self._unpark()
            if prefill is not None and op != "pass":    # a pass is queued behind the prefill
                prefill.add_done_callback(partial(self._after_prefill, msg))
                return _PENDING
        return spec.handler(self, msg)

    def _after_prefill(self, msg: dict[str, Any], prefill: Future) -> None:
        # Runs on the engine thread: hand over to the loop.
        try:
            self.loop.call_soon_threadsafe(self._answer_after, msg, prefill)
        except RuntimeError:
            pass   # the server closed meanwhile

    def _answer_after(self, msg: dict[str, Any], prefill: Future) -> None:
        """Answer a request that waited for the parked sets to come back (not retrying a failed
        prefill: the next request does)."""
        e = prefill.exception()
        if e is not None:
            self.send(wire.error(msg["id"], type(e).__name__, str(e)))
        else:
            self._answer(msg["id"], msg)

    def _owner(self, value: Any) -> str | None:
        # the saved sets of another owner do not exist for this connection, whatever it asks
        if value != self.owner:
            raise BadRequest("a connection acts only for the owner it named at its handshake")
        return value

    def _own(self, value: Any) -> int:
        seq = _int(value, "seq")
        if seq not in self.owned:   # another connection's sequences do not exist for this one
            raise UnknownSequence(f"unknown sequence {seq} (never created on this connection, or freed)")
        return seq

    # ---- ops -------------------------------------------------------------------------------------------
    def _op_info(self, msg: dict[str, Any]) -> wire.Info:
        return self.server.info

    def _op_stats(self, msg: dict[str, Any]) -> wire.Stats:
        return self.server.stats()

    def _op_usage(self, msg: dict[str, Any]) -> int:
        """The input rows the engine ran for this connection's passes so far."""
        return self.engine.tokens_by_owner.get(self.id, 0)

    def _op_idle(self, msg: dict[str, Any]) -> None:
        self.engine.idle(self.id)

    def _op_park(self, msg: dict[str, Any]) -> None:
        self.engine.park(list(self.owned))
        self.parked = True

    def _unpark(self) -> Future | None:
        """Bring the parked sets back (Engine.unpark): the future of their prefill, if any."""
        prefill = self.engine.unpark(list(self.owned), self.id)
        self.parked = False
        if prefill is not None:
            prefill.add_done_callback(self._prefill_done)
        return prefill

    def _prefill_done(self, future: Future) -> None:
        # A set whose prefill failed is parked again (saved.py): the next request on one tries again.
        if future.exception() is not None:
            try:
                self.loop.call_soon_threadsafe(setattr, self, "parked", True)
            except RuntimeError:
                pass   # the server closed meanwhile

    def _room_for_a_sequence(self) -> None:
        limit = self.engine.config.max_sequences
        if len(self.owned) >= limit:
            raise BadRequest(f"a connection may hold at most {limit} sequences (working sets) at once; "
                             "free some first")

    def _op_create(self, msg: dict[str, Any]) -> int:
        self._room_for_a_sequence()
        seq = self.engine.create_sequence(self.partition)
        self.owned.add(seq)
        return seq

    def _op_fork(self, msg: dict[str, Any]) -> int:
        parent = self._own(msg["seq"])
        self._room_for_a_sequence()
        child = self.engine.fork(parent)
        self.owned.add(child)
        return child

    def _op_free(self, msg: dict[str, Any]) -> None:
        seq = self._own(msg["seq"])
        self.owned.discard(seq)
        self.engine.free(seq)

    def _op_seq_state(self, msg: dict[str, Any]) -> wire.SeqState:
        return self.engine.seq_state(self._own(msg["seq"]))

    def _op_reserve(self, msg: dict[str, Any]) -> None:
        seq, end = self._own(msg["seq"]), _int(msg["end"], "end")
        if not 0 <= end <= self.engine.model_config.max_position_embeddings:
            raise BadRequest(f"reserve end {end} outside [0, {self.engine.model_config.max_position_embeddings}]")
        self.engine.reserve(seq, end)

    # ---- saved working sets --------------------------------------------------------------------------
    def _op_save(self, msg: dict[str, Any]) -> int:
        return self.engine.save(self._own(msg["seq"]), _name(msg["name"]), self._owner(msg["owner"]))

    def _op_open(self, msg: dict[str, Any]) -> object:
        self._room_for_a_sequence()
        seq, future = self.engine.open(_name(msg["name"]), self._owner(msg["owner"]))
        self.owned.add(seq)
        future.add_done_callback(partial(self._pass_done, msg["id"]))
        return _PENDING

    def _op_saved(self, msg: dict[str, Any]) -> list[wire.SavedSet]:
        return self.engine.list_saved(self._owner(msg["owner"]))

    def _op_delete_saved(self, msg: dict[str, Any]) -> None:
        self.engine.delete_saved(_name(msg["name"]), self._owner(msg["owner"]))

    def _op_pass(self, msg: dict[str, Any]) -> object:
        lanes_in = msg["lanes"]
        if not isinstance(lanes_in, list):
            raise BadRequest("lanes must be a list of lane maps")
        lanes = [self._lane(i, lane) for i, lane in enumerate(lanes_in)]
        rows = [len(lane.readout) if lane.readout is not None else 1 for lane in lanes]
        channels, store = self.channels, self.engine.channels
        kind = _epilogue_kind(msg["epilogue"])
        programs = []                     # the pass's eta programs: their channels are its channels
        if kind == "program":
            pid = msg["epilogue"].get("id")
            programs.append(self._program(pid))
            request = PassRequest(lanes, *self._epilogues(pid, rows))
        else:
            request = PassRequest(lanes, SIMPLE_EPILOGUES[kind],
                                  ROWS_EPILOGUES.get(kind) if rows == [1] else None)
        if msg.get("prologue") is not None:
            programs.append(self._program(msg["prologue"]))
            request.prologue = prologue_runner(programs[-1], store, channels)
        for site, pid in self._adapters(msg.get("adapters")):
            programs.append(self._program(pid))
            request.adapters.append((*site, adapter_fn(programs[-1], store, channels)))
        used = {lane.tokens_from for lane in lanes if lane.tokens_from is not None}
        request.channels = sorted(used.union(*(p.channels for p in programs)))
        if msg.get("repeat") is not None:
            request.repeat = self._repeat(msg["repeat"])
            self.repeats[msg["id"]] = request
        request.owner = self.id
        self.engine.submit(request).add_done_callback(partial(self._pass_done, msg["id"]))
        return _PENDING

    def _epilogues(self, pid: int, rows: list[int]) -> tuple[Epilogue, RowEpilogue | None]:
        """Program `pid`'s epilogue for passes reading `rows` (built once a connection: the same
        program serves every pass of a decode loop), and its batched form where it has one."""
        key = (pid, tuple(rows))
        made = self._made.get(key)
        if made is None:
            program = self.programs[pid]
            made = self._made[key] = (
                program_epilogue(program, rows, self.engine.channels, self.channels),
                lanes_program_epilogue(program, self.engine.channels, self.channels)
                if rows == [1] and program.lanewise else None)
        return made

    def _program(self, pid: Any) -> Program:
        if type(pid) is not int or not 0 <= pid < len(self.programs):
            raise BadRequest(f"unknown program {pid!r} (register it with the 'program' op)")
        return self.programs[pid]

    def _adapters(self, spec: Any) -> list[tuple[tuple[str, int | None], Any]]:
        if spec is None:
            return []
        if not isinstance(spec, list) or not all(isinstance(a, list) and len(a) == 2 for a in spec):
            raise BadRequest("adapters must be a list of [site, program id] pairs")
        try:
            return [(parse_site(site, self.engine.model_config.num_layers), pid) for site, pid in spec]
        except ValueError as e:
            raise BadRequest(str(e)) from None

    @staticmethod
    def _repeat(spec: Any) -> Repeat:
        if not isinstance(spec, dict) or type(spec.get("budget")) is not int or type(spec.get("window")) is not int \
                or spec["budget"] < 1 or spec["window"] < 1:
            raise BadRequest("repeat must be a map with positive integers 'budget' and 'window'")
        return Repeat(spec["budget"], spec["window"])

    def _lane(self, i: int, lane: Any) -> Lane:
        if not isinstance(lane, dict) or not {"seq", "tokens"} <= lane.keys() or lane.keys() - _LANE_FIELDS:
            raise BadRequest(f"lane {i}: a map with 'seq' and 'tokens' and optional "
                             f"{sorted(_LANE_FIELDS - {'seq', 'tokens'})}")
        at = f"lane {i}: "
        fold = lane.get("fold", True)
        if type(fold) is not bool:
            _int(fold, at, "fold")
        tokens_from = _optional(_int, lane.get("tokens_from"), at, "tokens_from")
        if tokens_from is not None:
            self._chan(tokens_from)
        return Lane(seq=self._own(lane["seq"]), tokens=_ints(lane["tokens"], at, "tokens"),
                    positions=_optional(_ints, lane.get("positions"), at, "positions"),
                    slots=_optional(_ints, lane.get("slots"), at, "slots"),
                    kv_len=_optional(_int, lane.get("kv_len"), at, "kv_len"),
                    mask=_optional(_mask, lane.get("mask"), at, "mask"), fold=fold,
                    readout=_optional(_ints, lane.get("readout"), at, "readout"),
                    checkpoints=_optional(_ints, lane.get("checkpoints"), at, "checkpoints"),
                    tokens_from=tokens_from)

    # ---- programs, channels, repeats -------------------------------------------------------------------
    def _op_program(self, msg: dict[str, Any]) -> int:
        ir = msg["ir"]
        if not isinstance(ir, str):
            raise BadRequest("program: 'ir' is the JSON text of an eta program")
        limit = self.engine.config.max_programs
        if len(self.programs) >= limit:
            raise BadRequest(f"a connection may register at most {limit} programs (trace an "
                             "epilogue once and reuse it; values that change go through channels)")
        self.programs.append(self.engine.programs.get(ir, self.engine.worker.device))
        return len(self.programs) - 1

    def _chan(self, value: Any) -> int:
        cid = _int(value, "chan")
        if cid not in self.channels:
            raise ChannelError(f"channel {cid} does not exist (never created on this connection, or freed)")
        return cid

    def _op_chan_create(self, msg: dict[str, Any]) -> int:
        cid = self.engine.channels.create(msg["shape"], msg["dtype"], msg.get("capacity", 1), msg.get("values"))
        self.channels.add(cid)
        return cid

    def _op_chan_put(self, msg: dict[str, Any]) -> None:
        cid = self._chan(msg["chan"])
        if msg.get("bits") is None:
            self.engine.channels.put(cid, msg["value"])
        else:
            self.engine.channels.put_bits(cid, _ints(msg["value"], "value"), _int(msg["bits"], "bits"))

    def _op_chan_take(self, msg: dict[str, Any]) -> Any:
        return self.engine.channels.take(self._chan(msg["chan"])).tolist()

    def _op_chan_subscribe(self, msg: dict[str, Any]) -> None:
        self.engine.channels.subscribe(self._chan(msg["chan"]), self._push_channel)

    def _op_chan_free(self, msg: dict[str, Any]) -> None:
        cid = self._chan(msg["chan"])
        self.channels.discard(cid)
        self.engine.channels.free(cid)

    def _push_channel(self, cid: int, value: Any, error: str | None) -> None:
        # Called on the engine thread (an epilogue's put) or on this loop (subscribe): hand over.
        push = {"push": "chan", "chan": cid, **({"error": error} if error is not None else {"value": value})}
        try:
            self.loop.call_soon_threadsafe(self.send, push)
        except RuntimeError:
            pass   # the server closed meanwhile

    def _repeating(self, value: Any) -> PassRequest:
        request = self.repeats.get(_int(value, "pass"))
        if request is None:
            raise BadRequest(f"no repeating pass with request id {value!r} is running")
        return request

    def _op_repeat_ack(self, msg: dict[str, Any]) -> None:
        self.engine.ack(self._repeating(msg["pass"]), _int(msg["read"], "read"))

    def _op_repeat_stop(self, msg: dict[str, Any]) -> None:
        self.engine.stop(self._repeating(msg["pass"]), _optional(_int, msg.get("keep"), "keep"))

    def _pass_done(self, id: int, future: Future) -> None:
        # Runs on the engine thread (or here, if the pass failed at once): hand over to the loop.
        try:
            self.loop.call_soon_threadsafe(self._reply_pass, id, future)
        except RuntimeError:
            pass   # the server closed meanwhile: nobody is left to answer

    def _reply_pass(self, id: int, future: Future) -> None:
        self.repeats.pop(id, None)
        e = future.exception()
        if e is not None:
            self.send(wire.error(id, type(e).__name__, str(e)))
            return
        try:
            frame = wire.pack(wire.reply(id, future.result()))
        except (TypeError, ValueError) as e:
            frame = wire.pack(wire.error(id, "EpilogueError", f"epilogue result cannot be sent: {e}"))
        if not self.writer.is_closing():
            self.writer.write(frame)

    def release(self) -> None:
        """Free every sequence and channel this connection still owns (it closed)."""
        self.engine.forget(self.id)
        for request in list(self.repeats.values()):
            self.engine.stop(request)
        self.repeats.clear()
        for cid in self.channels:
            self.engine.channels.free(cid)
        self.channels.clear()
        for seq in self.owned:
            try:
                self.engine.free(seq)
            except KVStoreError:
                pass   # already gone: nothing to return
        self.owned.clear()


class _Op(NamedTuple):
    """A data-plane request: its handler, its fields, and whether it uses the connection's working
    sets (which a parked connection brings back first)."""
    handler: Callable[[_Connection, dict[str, Any]], Any]
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    uses_sets: bool = False


C = _Connection
_OPS: dict[str, _Op] = {                     # every request the data plane answers (wire.py)
    "info": _Op(C._op_info), "stats": _Op(C._op_stats), "usage": _Op(C._op_usage), "idle": _Op(C._op_idle),
    "park": _Op(C._op_park),
    "create": _Op(C._op_create), "fork": _Op(C._op_fork, ("seq",), uses_sets=True),
    "free": _Op(C._op_free, ("seq",)), "seq_state": _Op(C._op_seq_state, ("seq",), uses_sets=True),
    "reserve": _Op(C._op_reserve, ("seq", "end"), uses_sets=True),
    "save": _Op(C._op_save, ("seq", "name", "owner"), uses_sets=True), "open": _Op(C._op_open, ("name", "owner")),
    "saved": _Op(C._op_saved, ("owner",)), "delete_saved": _Op(C._op_delete_saved, ("name", "owner")),
    "pass": _Op(C._op_pass, ("lanes", "epilogue"), ("prologue", "repeat", "adapters"), uses_sets=True),
    "program": _Op(C._op_program, ("ir",)),
    "chan_create": _Op(C._op_chan_create, ("shape", "dtype"), ("capacity", "values")),
    "chan_put": _Op(C._op_chan_put, ("chan", "value"), ("bits",)), "chan_take": _Op(C._op_chan_take, ("chan",)),
    "chan_subscribe": _Op(C._op_chan_subscribe, ("chan",)), "chan_free": _Op(C._op_chan_free, ("chan",)),
    "repeat_ack": _Op(C._op_repeat_ack, ("pass", "read")), "repeat_stop": _Op(C._op_repeat_stop, ("pass",), ("keep",)),
}
del C


def serve_model(config: EngineConfig, host: str = "127.0.0.1", port: int = 0, *, long_lived: bool = False,
                own_process: bool = False) -> tuple[EngineServer, wire.EngineAddress]:
    """Build the engine `config` describes (see `Engine.from_config` for `long_lived`, `Engine.start`
    for `own_process`), start its batching loop and serve it. Returns the server and its address
    (with its secret); stop with `server.close(); server.engine.close()`."""
    server = EngineServer(Engine.from_config(config, long_lived=long_lived).start(own_process))
    return server, server.start(host, port)
