"""Security: the engine's data plane authenticates, inferlets cannot reach Ray, the prefix cache is
partitioned per API key, per-key quotas answer 429 in each API's shape, and a key sees only its own
processes, saved working sets and messages.

The data-plane cases use the dummy model (an engine step of next to nothing) and raw sockets, so
that a client can send anything at all; the pie serve cases use the default model through the
official SDKs, each in pairs: what one key may do, next to what another key may not.
"""
from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest

from pie_actors import Runtime
from pie_actors.gpu.engine import data_plane, wire
from pie_actors.gpu.engine.data_plane import EngineServer
from pie_actors.inferlet.engine_client import EngineClient, EngineError
from tests.engine_helpers import make_engine

PROMPT = [5, 6, 7, 8]


# ---- the data plane authenticates ----------------------------------------------------------------

@pytest.fixture(scope="module")
def plane():
    """dummy-small's engine on its data plane: (engine, server)."""
    engine = make_engine("dummy-small", num_pages=64).start()
    server = EngineServer(engine)
    server.start()
    yield engine, server
    server.close()
    engine.close()


def raw_frames(address: wire.EngineAddress, body: bytes | None) -> list[dict]:
    """Connect, read the hello, send `body` as a frame (None: nothing, until the server gives up),
    and return every frame the server sends until it closes: the hello first."""
    frames = []
    with socket.create_connection(address[:2], timeout=30) as sock:
        stream = sock.makefile("rb")
        def read() -> dict | None:
            header = stream.read(wire.HEADER.size)
            if len(header) < wire.HEADER.size:
                return None
            return wire.unpack(stream.read(wire.HEADER.unpack(header)[0]))
        frames.append(read())
        if body is not None:
            sock.sendall(wire.HEADER.pack(len(body)) + body)
        while (frame := read()) is not None:
            frames.append(frame)
    return frames


def request_body(op: str = "create", **fields) -> bytes:
    return msgpack.packb(wire.request(1, op, **fields))


def refusal(frames: list[dict]) -> dict:
    """The one frame after the hello, checked to be the Unauthorized error (and nothing else came)."""
    hello, *rest = frames
    assert isinstance(hello["hello"], bytes) and len(hello["hello"]) == wire.NONCE_BYTES
    assert len(rest) == 1 and rest[0]["id"] is None and rest[0]["error"]["type"] == "Unauthorized", rest
    return rest[0]


async def greedy(client: EngineClient, tokens: list[int], n: int) -> list[int]:
    seq, out = await client.create(), []
    for _ in range(n):
        [token] = await client.forward([{"seq": seq, "tokens": tokens}])
        out.append(token)
        tokens = [token]
    await client.free(seq)
    return out


def test_a_connection_that_does_not_prove_the_secret_is_refused_before_any_request(plane, monkeypatch):
    engine, server = plane
    monkeypatch.setattr(data_plane, "HANDSHAKE_TIMEOUT_S", 0.5)
    want = engine.generate([PROMPT], 3, ignore_eos=True)[0]
    address = server.address

    async def main() -> tuple[list[int], list[int]]:
        # a connection made before the attempts keeps serving through them
        async with await EngineClient.connect(*address) as bystander:
            before = await greedy(bystander, PROMPT, 3)
            stats = server.stats()
            pass_body = request_body("pass", lanes=[{"seq": 0, "tokens": PROMPT}], epilogue=wire.ARGMAX)
            nonce = raw_frames(address, None)[0]["hello"]               # silent: refused at the timeout
            attempts = [
                await asyncio.to_thread(raw_frames, address, pass_body),  # requests at once, no handshake
                await asyncio.to_thread(raw_frames, address, msgpack.packb({"auth": address.secret})),  # in clear
                await asyncio.to_thread(raw_frames, address, msgpack.packb(
                    {"auth": wire.proof(b"not the secret", b"x" * 32), "owner": None})),
                await asyncio.to_thread(raw_frames, address, msgpack.packb(   # replayed: another nonce's proof
                    {"auth": wire.proof(address.secret, nonce), "owner": None})),
                await asyncio.to_thread(raw_frames, address, b"\xc1 not msgpack"),
            ]
            for frames in attempts:
                assert "secret" in refusal(frames)["error"]["message"]
            with pytest.raises(EngineError) as wrong:
                await EngineClient.connect(address.host, address.port, b"guessed")
            assert wrong.value.type == "Unauthorized"
            after = server.stats()
            # nothing the refused connections sent was read as a request, and no pass ran for them
            assert after["requests"] == stats["requests"]
            assert after["batch_sizes"] == stats["batch_sizes"]
            assert after["refused"] == stats["refused"] + len(attempts) + 2     # the silent one, the client
            assert after["connections"] == 1
            return before, await greedy(bystander, PROMPT, 3)

    before, after = asyncio.run(main())
    assert before == after == want
    assert engine.kv_stats()["referenced"] == 0


def test_the_address_keeps_its_secret_out_of_messages(plane, tmp_path):
    """The runtime hands the address with its secret to its own actors; printed, it is host:port."""
    _, server = plane
    address = server.address
    assert len(address.secret) == 32 and address.secret != EngineServer(server.engine).secret
    shown = f"{address} {address!r} {[address]}"
    assert address.secret.hex() not in shown and repr(address.secret) not in shown
    assert str(address) == f"{address.host}:{address.port}"


GUEST_REACH = """
import importlib

def attempt(fn):
    try:
        fn()
        return "done"
    except BaseException as e:
        return type(e).__name__

async def main(input):
    import socket, subprocess
    out = {name: attempt(lambda: importlib.import_module(name)) for name in ("ray", "pie_actors", "ctypes")}
    out["socket"] = attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(
        ("127.0.0.1", input["port"])))
    out["resolve"] = attempt(lambda: socket.create_connection(("localhost", input["port"]), timeout=1))
    out["subprocess"] = attempt(lambda: subprocess.run(["true"]))
    return out
"""


def test_an_inferlet_cannot_reach_ray_or_the_engine_socket(monkeypatch):
    """The guest has no Ray and no network: it reaches the engine only through host operations,
    whose connection the host made (with the secret the guest never sees)."""
    with Runtime.local("dummy", dtype="float32", compile="off", num_pages=64, timeout_s=60) as runtime:
        refused = runtime.stats()["refused"]
        process = runtime.launch(GUEST_REACH, {"port": runtime.engine_address.port})
        out = process.result()
        # WASI grants the guest no socket, name lookup or process: each fails in the guest itself
        assert out == {"ray": "ModuleNotFoundError", "pie_actors": "ModuleNotFoundError",
                       "ctypes": "ModuleNotFoundError", "socket": "PermissionError", "resolve": "LookupError",
                       "subprocess": "OSError"}
        assert runtime.stats()["refused"] == refused     # it did not even get to try the engine
