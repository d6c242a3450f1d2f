"""Fuzzing the engine's data-plane decoder (data_plane.py, wire.py): malformed msgpack, frames that
are not requests, known ops with fields of the wrong types, huge claimed lengths. Each bad request
gets one error frame, the server never crashes, and the valid passes on the same connection, before
and after the bad frames, give exactly their tokens.

Requests are written on a plain blocking socket, so that any bytes at all can be sent.
"""
from __future__ import annotations

import socket

import msgpack
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from pie_actors.gpu.engine import wire
from pie_actors.gpu.engine.data_plane import _LANE_FIELDS, _OPS, EngineServer
from tests.engine_helpers import make_engine

PROMPT = [1, 2, 3]
FIELD_NAMES = sorted({f for spec in _OPS.values() for f in spec.required + spec.optional} | _LANE_FIELDS)
# ops that succeed whatever their (absent) fields say are left out: they are not bad requests
FUZZED_OPS = sorted(op for op, spec in _OPS.items() if spec.required)


@pytest.fixture(scope="module")
def server(default_model_dir):
    """dummy-small (512 token ids, an engine step of next to nothing) served on a local port."""
    engine = make_engine("dummy-small", num_pages=64).start()
    server = EngineServer(engine)
    server.start()
    yield server
    server.close()
    engine.close()


class Conn:
    """A blocking connection that sends raw frames and reads replies."""

    def __init__(self, address: wire.EngineAddress) -> None:
        self.sock = socket.create_connection(address[:2], timeout=30)
        self.ids = iter(range(1 << 40))
        nonce = self.read()["hello"]                 # the handshake first (wire.py)
        self.send_body(msgpack.packb({"auth": wire.proof(address.secret, nonce), "owner": None}))
        assert self.read() == wire.reply(None, "ready")

    def close(self) -> None:
        self.sock.close()

    def send_body(self, body: bytes) -> None:
        self.sock.sendall(wire.HEADER.pack(len(body)) + body)

    def request(self, op: str, **fields) -> int:
        id = next(self.ids)
        self.send_body(msgpack.packb(wire.request(id, op, **fields), use_bin_type=True))
        return id

    def read(self) -> dict | None:
        """The next reply; None when the server closed the connection."""
        header = self._exactly(wire.HEADER.size)
        if header is None:
            return None
        body = self._exactly(wire.HEADER.unpack(header)[0])
        return wire.unpack(body)

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def call(self, op: str, **fields):
        id = self.request(op, **fields)
        reply = self.read()
        assert reply["id"] == id and "result" in reply, reply
        return reply["result"]


@pytest.fixture(scope="module")
def want(server) -> list[int]:
    """The two greedy tokens after PROMPT, on a clean connection."""
    conn = Conn(server.address)
    seq = conn.call("create")
    [first] = conn.call("pass", lanes=[{"seq": seq, "tokens": PROMPT}], epilogue=wire.ARGMAX)
    [second] = conn.call("pass", lanes=[{"seq": seq, "tokens": [first]}], epilogue=wire.ARGMAX)
    conn.close()
    return [first, second]


# ---- what is sent ---------------------------------------------------------------------------------

# ints that are never a valid id here (sequences, channels, programs and passes count up from 0)
bad_ints = st.integers(-(1 << 63), -1) | st.integers(min_value=1 << 31, max_value=(1 << 64) - 1)
words = st.sampled_from(["f32", "i32", "bool", "argmax", "logits", "program", "seq", "tokens"])
leaves = (st.none() | st.booleans() | bad_ints | st.floats() | st.text(max_size=8) | words
          | st.binary(max_size=16) | st.builds(msgpack.ExtType, st.integers(0, 3), st.binary(max_size=16)))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), inner, max_size=4),
                      max_leaves=12)

# a msgpack header claiming far more than follows: str, bin, array, map, ext
huge_headers = st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\xc9"]).flatmap(
    lambda head: st.builds(lambda size, rest: head + size.to_bytes(4, "big") + rest,
                           st.integers(1 << 16, (1 << 32) - 1), st.binary(max_size=8)))


def _packed(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _not_msgpack(body: bytes) -> bool:
    try:
        msgpack.unpackb(body)
    except Exception:
        return True
    return False


# (frame body, the id its reply must carry (None: the id cannot be read), whether it must fail)
unreadable = (st.binary(max_size=32).filter(_not_msgpack) | huge_headers).map(lambda b: (b, None, True))
not_a_request = (values.filter(lambda v: not (isinstance(v, dict) and type(v.get("id")) is int))
                 .map(lambda v: (_packed(v), None, True)))


@st.composite
def fuzzed_requests(draw, id: int):
    """A map with an id and a known or unknown op, and fields of any name and type."""
    op = draw(st.sampled_from(FUZZED_OPS) | st.text(max_size=8))
    fields = draw(st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), values, max_size=5))
    fields.pop("id", None)
    required = _OPS[op].required if op in _OPS else ()
    # unknown ops and missing required fields are bad for sure; the rest are refused by their checks
    bad_for_sure = op not in _OPS or any(f not in fields for f in required)
    return _packed({"id": id, "op": op, **fields}), id, bad_for_sure


@st.composite
def frames(draw) -> list[tuple[bytes, int | None, bool]]:
    n = draw(st.integers(1, 6))
    return [draw(unreadable | not_a_request | fuzzed_requests(id=(1 << 30) + i)) for i in range(n)]


# ---- the tests ------------------------------------------------------------------------------------

@seed(20)
@settings(max_examples=150, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=frames())
def test_bad_frames_get_an_error_each_and_the_valid_passes_are_unaffected(server, want, bad):
    conn = Conn(server.address)
    try:
        seq = conn.call("create")
        before = conn.request("pass", lanes=[{"seq": seq, "tokens": PROMPT}], epilogue=wire.ARGMAX)
        for body, _, _ in bad:
            conn.send_body(body)
        after = conn.request("pass", lanes=[{"seq": seq, "tokens": [want[0]]}], epilogue=wire.ARGMAX)
        replies = [conn.read() for _ in range(len(bad) + 2)]
        assert None not in replies, "the server closed the connection"
        by_id: dict = {}
        for reply in replies:
            by_id.setdefault(reply["id"], []).append(reply)
        assert [r["result"] for r in by_id.pop(before)] == [[want[0]]]
        assert [r["result"] for r in by_id.pop(after)] == [[want[1]]]
        unread = [reply for reply in by_id.pop(None, [])]
        assert len(unread) == sum(id is None for _, id, _ in bad)
        assert all(r["error"]["type"] in ("BadFrame", "BadRequest") for r in unread), unread
        for _, id, must_fail in bad:
            if id is not None:
                [reply] = by_id.pop(id)
                assert "error" in reply or not must_fail, reply
        assert not by_id, by_id
    finally:
        conn.close()


def test_a_frame_longer_than_the_limit_ends_only_its_connection(server, want):
    # the stream cannot be resynchronised without reading the claimed length: an error, then close
    bystander = Conn(server.address)
    seq = bystander.call("create")
    conn = Conn(server.address)
    conn.sock.sendall(wire.HEADER.pack(wire.MAX_FRAME + 1))
    reply = conn.read()
    assert reply["id"] is None and reply["error"]["type"] == "BadFrame", reply
    assert conn.read() is None
    conn.close()
    assert bystander.call("pass", lanes=[{"seq": seq, "tokens": PROMPT}], epilogue=wire.ARGMAX) == [want[0]]
    bystander.close()
