"""The engine data plane's wire format: msgpack messages, each framed by a 4-byte big-endian length.

A connection first proves the engine's secret (`EngineAddress.secret`, made when the engine starts
and handed by the runtime to its own actors only). The server opens with `{"hello": nonce}` (32
random bytes); the client answers `{"auth": proof(secret, nonce), "owner": str | nil,
["kv_pages": n], ["starting": bool]}` (an HMAC of the nonce: the secret itself never crosses the
socket); the server replies `{"id": nil, "result": "ready"}`, or an Unauthorized error frame and
closes, before it reads any request. `owner` is the owner of the program the connection serves: the engine derives
the connection's prefix-cache partition from it with its secret (kvstore/prefix.py), so only that
owner's connections share cached pages. `kv_pages` bounds the pages that owner's working sets hold
together (0: no bound; the latest connection's value holds for the owner); past it an allocation
fails with QuotaExceeded. `starting`: the connection is made at its program's launch, whose first
pass is still to come (the scheduler's gather of first passes waits for it: scheduler.py).

A client sends requests `{"id": int, "op": str, ...fields}`; the engine answers each with
`{"id": id, "result": ...}` or `{"id": id, "error": {"type": str, "message": str}}`. Many requests
may be in flight on one connection; responses come back in completion order, matched by `id`.
A frame that is not a well-formed request is answered with `id` None (when its id cannot be read)
and the connection stays usable; only a frame longer than MAX_FRAME ends it (the stream cannot be
resynchronised without reading the whole claimed length).

Requests (op: fields -> result):
    info:      -> Info
    create:    -> seq id (int)
    fork:      seq -> child seq id (int); the child shares seq's frozen prefix
    free:      seq -> None
    seq_state: seq -> SeqState
    reserve:   seq, end -> None; pages for local slots [0, end), for explicit-geometry passes
    pass:      lanes: [LaneSpec], epilogue: {"kind": ...}, [prologue: program id],
               [adapters: [[site, program id]]], [repeat: {"budget": n, "window": w}]
               -> the epilogue's output (a repeating pass: the number of runs kept, when it ends)
    program:   ir (the JSON text of an eta program) -> program id on this connection
    chan_create: shape, dtype, [capacity], [values] -> channel id (owned by the connection)
    chan_put:  chan, value, [bits: n] -> None; with bits, value is a bool of n elements packed
               in int32 words (element i: bit i % 32 of word i // 32)
    chan_take: chan -> value (error when empty)
    chan_subscribe: chan -> None; from now on values put into it are pushed (below)
    chan_free: chan -> None
    repeat_ack:  pass (the repeating pass's request id), read -> None: `read` runs' outputs were read
    repeat_stop: pass, [keep] -> None: stop repeating, cut the runs after the first `keep`
    save:      seq, name, owner -> tokens kept (int); seq's frozen prefix becomes owner's saved set
               `name`, replacing one of that name (gpu/engine/saved.py)
    open:      name, owner -> Opened; a new sequence holding owner's saved set `name`
    saved:     owner -> [SavedSet], by name
    delete_saved: name, owner -> None
    stats:     -> Stats
    idle:      -> None; the connection's program waits on something other than the engine, so the
               next batch does not wait for its next pass (scheduler.py)
    park:      -> None; the program waits for a message with no pass in flight: the connection's
               working sets are the first to leave the KV pool when it runs short, to host memory
               or as their tokens (gpu/engine/saved.py). Its next request that uses one (pass,
               fork, seq_state, reserve, save) brings them all back first: a pass is queued behind
               the prefill of those kept as tokens, the others are answered once it ran. A pass in
               flight on a set that leaves fails, so a client parks only with none in flight

Epilogue kinds: "argmax" -> [int] (one token per readout row);
"logits" -> float32 tensor [readout rows, vocab]; "program" with "id" -> [output values] of a
registered eta program (lists / numbers).

Pushes (server -> client, no id): {"push": "chan", "chan": id, "value": v} for each value put into a
subscribed channel, or {"push": "chan", "chan": id, "error": message} when a failed pass poisoned it.

`owner` (a string or nil) is the owner of the program the connection serves, as the inferlet host
that connects knows it from the launch: programs never reach the data plane themselves. A request
that names another owner than the handshake's is a BadRequest.

Error types: Unauthorized (the handshake failed), BadFrame, BadRequest, UnknownSequence (never
created, already freed, or another connection's), Evicted (a parked set that could not come back),
PassError, OutOfPages, QuotaExceeded (the owner's kv_pages bound), InvalidSlot, KVStoreError,
UnknownSaved, EpilogueError; anything else is the name of an unexpected engine exception.

Tensors travel as msgpack extension type TENSOR_EXT: dtype char (struct format, e.g. "f"), ndim,
ndim little-endian uint32 dims, then the little-endian elements; they decode to a `memoryview`
of that format and shape (`.tolist()`, or `numpy.asarray(view)` without a copy).

This module imports only msgpack: inferlet actors use it and must stay light.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from typing import Any, NamedTuple, TypedDict

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20
TENSOR_EXT = 1

ARGMAX = {"kind": "argmax"}
LOGITS = {"kind": "logits"}
NONCE_BYTES = 32
MAX_AUTH_FRAME = 4096         # the handshake's answer is a proof and an owner: no more is read before it


class EngineAddress(NamedTuple):
    """Where an engine's data plane listens and the secret its connections prove. Its repr leaves
    the secret out, so an address in a log or an error message gives nothing away."""

    host: str
    port: int
    secret: bytes

    def __repr__(self) -> str:
        return f"{self.host}:{self.port}"

    __str__ = __repr__


def proof(secret: bytes, nonce: bytes) -> bytes:
    """What a client sends for the server's `nonce`: HMAC-SHA256 of it under the engine's secret."""
    return hmac.new(secret, b"pie-data-plane:" + nonce, hashlib.sha256).digest()


def proves(secret: bytes, nonce: bytes, answer: Any) -> bool:
    """Whether a handshake answer holds the proof for `nonce` (compared in constant time)."""
    given = answer.get("auth") if isinstance(answer, dict) else None
    return isinstance(given, bytes) and hmac.compare_digest(given, proof(secret, nonce))


class LaneSpec(TypedDict, total=False):
    """One sequence's rows in a pass; the fields of `pie_actors.gpu.engine.scheduler.Lane` (seq, tokens required)."""

    seq: int
    tokens: list[int]
    tokens_from: int | None       # a channel the tokens are taken from when the pass runs
    positions: list[int] | None
    slots: list[int] | None
    kv_len: int | None
    mask: list[list[bool]] | None
    fold: bool | int
    readout: list[int] | None
    checkpoints: list[int] | None  # slots to keep the recurrent state at (hybrid models)


class Info(TypedDict):
    model: str
    model_dir: str            # valid on the engine's node only
    architecture: str
    dtype: str                # what the engine runs in ("float32", "bfloat16", ...)
    device: str
    vocab_size: int           # rows of the output logits
    page_size: int
    max_position: int
    eos_ids: list[int]


class SeqState(TypedDict):
    length: int
    folded: int
    cached_tokens: int


class Opened(TypedDict):
    seq: int
    restored: str             # "kept" (its pages were in the pool), "spilled" (back from host
                              # memory) or "recomputed" (its tokens prefilled again)
    tokens: int


class SavedSet(TypedDict):
    name: str
    state: str                # "kept", "spilled" or "tokens" (only the history is left)
    tokens: int


class Stats(TypedDict):
    batch_sizes: dict[int, int]   # lanes per batch -> batches run
    decode_batch_sizes: dict[int, int]   # the same, of batches of one row a lane (decode steps)
    tokens_computed: int          # input rows the model ran, prefill and decode (what prefix reuse saves)
    hold: dict[str, float]        # the scheduler's waits for coming programs (scheduler.Arrivals)
    row_epilogues: dict[str, int] # epilogues run once for many passes: calls, passes they served
    step_seconds: dict[str, float]  # executed steps' time by part: plan, model, epilogue, finish; plan_cpu, finish_cpu; steps
    kv: dict[str, int]            # total, free, referenced, cached pages
    states: dict[str, int]        # recurrent-state slots: total, free, held, snapshots, and pages_each
                                  # (what a held one counts against a page bound); all 0 without
    saved: dict[str, int]         # saved sets by state (kept, spilled, tokens), spill_bytes,
                                  # evictions (evicted_spilled, _tokens), and opens by how they
                                  # restored (opened_kept, _spilled, _recomputed)
    parked: dict[str, int]        # the sets of parked programs: sets, by state (kept, spilled,
                                  # tokens), spill_bytes; evicted_spilled, evicted_tokens and
                                  # restored_spilled, restored_recomputed so far
    connections: int
    refused: int                  # connections closed for a missing or wrong handshake proof
    requests: int                 # frames the data plane received, all connections together
    sequences: int                # owned by open connections
    channels: int
    programs: dict[str, int]      # compiled, cache_hits
    compile: dict[str, int]       # compiled decode buckets: ready, total, compiling (its batch
                                  # size; 0: none), failed (compiled_decode.Progress)


class FrameTooLarge(ValueError):
    """A frame header claims more than MAX_FRAME bytes."""


def tensor(fmt: str, shape: tuple[int, ...] | list[int], data: bytes) -> msgpack.ExtType:
    """A tensor for the wire: `data` holds prod(shape) little-endian elements of struct format `fmt`."""
    header = struct.pack(f"<cB{len(shape)}I", fmt.encode(), len(shape), *shape)
    return msgpack.ExtType(TENSOR_EXT, header + data)


def _ext_hook(code: int, payload: bytes) -> Any:
    if code != TENSOR_EXT:
        return msgpack.ExtType(code, payload)
    try:
        fmt, ndim = struct.unpack_from("<cB", payload)
        shape = struct.unpack_from(f"<{ndim}I", payload, 2)
        return memoryview(payload)[2 + 4 * ndim:].cast(fmt.decode(), shape)
    except (struct.error, ValueError, TypeError):
        # left as it came, a value no field accepts: the request it is in fails by its own id
        # (had the frame failed whole, the error could not name the call it answers)
        return msgpack.ExtType(code, payload)


def pack(message: dict[str, Any]) -> bytes:
    """One frame: length header + msgpack body."""
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> Any:
    """The message in a frame body; raises ValueError (or a msgpack error) when it is not msgpack."""
    return msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=_ext_hook)


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes:
    """The next frame's body. Raises asyncio.IncompleteReadError at end of stream, FrameTooLarge
    past `limit` bytes."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > limit:
        raise FrameTooLarge(f"frame of {size} bytes exceeds the {limit}-byte limit")
    return await reader.readexactly(size)


def request(id: int, op: str, **fields: Any) -> dict[str, Any]:
    return {"id": id, "op": op, **fields}


def reply(id: int | None, result: Any) -> dict[str, Any]:
    return {"id": id, "result": result}


def error(id: int | None, type: str, message: str) -> dict[str, Any]:
    return {"id": id, "error": {"type": type, "message": message}}
