"""The data plane: EngineServer + EngineClient over TCP, EngineActor in Ray, and the dummy model."""
from __future__ import annotations

import asyncio
import hashlib
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pie_actors import model_store
from pie_actors.gpu.engine import wire
from pie_actors.cli import main as pie_main
from pie_actors.gpu.engine.data_plane import EngineServer
from pie_actors.config import RunLimits
from pie_actors.gpu.engine.engine import Engine
from pie_actors.inferlet.engine_client import EngineClient, EngineError
from pie_actors.inferlet.run import Run
from pie_actors.launch import Launch
from pie_actors.process import Done, Failed, Send
from pie_actors.program import Program
from tests.engine_helpers import decode, serve

PROMPTS = [
    "The capital of France is", "List three colors:", "def add(a, b):", "Water boils at",
    "My favourite book is", "1, 2, 3, 4,", "The quick brown fox", "In 1492, Columbus",
    "Once upon a time", "The best way to learn", "SELECT * FROM", "Dear Sir or Madam,",
    "import numpy as np", "Roses are red,", "The meaning of life is", "Step 1: preheat the oven",
]


@pytest.fixture(scope="module")
def served(default_model_dir):
    """The default model's engine (float32) served on a local port: (engine, server)."""
    yield from serve(default_model_dir)


def referenced(server: EngineServer) -> int:
    return server.stats()["kv"]["referenced"]


def test_greedy_through_client_equals_engine(served):
    engine, server = served
    prompt = engine.tokenizer.encode(PROMPTS[0])
    want = engine.generate([prompt], 6, ignore_eos=True)[0]

    async def main():
        async with await EngineClient.connect(*server.address) as client:
            info = await client.info()
            seq = await client.create()
            logits = await client.forward([{"seq": seq, "tokens": prompt}], wire.LOGITS)
            state = await client.state(seq)
            return info, logits, state, await decode(client, prompt, 6)

    info, logits, state, got = asyncio.run(main())
    assert got == want
    assert info["vocab_size"] == 49152 and info["architecture"] == "llama" and info["eos_ids"] == [2, 0]
    assert logits.shape == (1, 49152) and logits.format == "f"
    row = logits.tolist()[0]
    assert row.index(max(row)) == want[0]
    assert state == {"length": len(prompt), "folded": len(prompt), "cached_tokens": 0}


def test_concurrent_clients_are_batched_and_get_their_alone_tokens(served):
    engine, server = served
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    alone = [engine.generate([p], 4, ignore_eos=True)[0] for p in prompts]
    start = referenced(server)

    async def one_connection():
        async with await EngineClient.connect(*server.address) as client:
            return await asyncio.gather(*(decode(client, p, 4) for p in prompts))

    async def own_connection(prompt):
        async with await EngineClient.connect(*server.address) as client:
            return await decode(client, prompt, 4)

    async def many_connections():
        return await asyncio.gather(*(own_connection(p) for p in prompts))

    for run in (one_connection, many_connections):
        batches = dict(engine.batch_sizes)
        assert asyncio.run(run()) == alone, run.__name__
        grew = [size for size, n in engine.batch_sizes.items() if n > batches.get(size, 0)]
        assert max(grew) > 1, f"{run.__name__}: no pass was batched with another"
    assert referenced(server) == start


def test_bad_requests_fail_alone(served):
    engine, server = served
    prompt = engine.tokenizer.encode(PROMPTS[1])
    want = engine.generate([prompt], 4, ignore_eos=True)[0]

    async def raw_exchange(frames: list[bytes]) -> list[dict]:
        reader, writer = await asyncio.open_connection(*server.address[:2])
        await EngineClient.handshake(reader, writer, server.secret)
        writer.write(b"".join(frames))
        replies = [wire.unpack(await wire.read_frame(reader)) for _ in frames]
        writer.close()
        return replies

    async def bad(client: EngineClient, other: EngineClient) -> dict[str, EngineError]:
        seq, foreign = await client.create(), await other.create()
        calls = {
            "out of vocabulary": client.forward([{"seq": seq, "tokens": [1, 10**6]}]),
            "unknown sequence": client.forward([{"seq": 10**9, "tokens": [1]}]),
            "other connection's sequence": client.forward([{"seq": foreign, "tokens": [1]}]),
            "free other's": client.free(foreign),
            "tokens not ints": client.call("pass", lanes=[{"seq": seq, "tokens": "abc"}], epilogue=wire.ARGMAX),
            "lanes not a list": client.call("pass", lanes="x", epilogue=wire.ARGMAX),
            "unknown lane field": client.call("pass", lanes=[{"seq": seq, "tokens": [1], "readouts": [0]}],
                                              epilogue=wire.ARGMAX),
            "unknown epilogue": client.forward([{"seq": seq, "tokens": [1]}], {"kind": "nope"}),
            "reserve end not int": client.call("reserve", seq=seq, end="9"),
            "unknown op": client.call("explode"),
        }
        errors = {}
        for name, call in calls.items():
            with pytest.raises(EngineError) as e:
                await call
            errors[name] = e.value
        assert await client.state(seq) == {"length": 0, "folded": 0, "cached_tokens": 0}
        return errors

    async def main():
        async with await EngineClient.connect(*server.address) as client, \
                await EngineClient.connect(*server.address) as other:
            good = asyncio.ensure_future(decode(client, prompt, 4))
            errors = await bad(client, other)
            raw = await raw_exchange([
                wire.HEADER.pack(3) + b"\xc1\xc1\xc1",               # not msgpack
                wire.pack([1, 2]),                                   # not a request map
                wire.pack(wire.request("7", "info")),            # id not an int
                wire.pack(wire.request(7, "free", seq=None)),    # seq not an int
                wire.pack(wire.request(8, "info")),              # the connection still serves
            ])
            return await good, errors, raw

    good, errors, raw = asyncio.run(main())
    assert good == want
    types = {name: e.type for name, e in errors.items()}
    assert types == {
        "out of vocabulary": "PassError", "unknown sequence": "UnknownSequence",
        "other connection's sequence": "UnknownSequence", "free other's": "UnknownSequence",
        "tokens not ints": "BadRequest", "lanes not a list": "BadRequest", "unknown lane field": "BadRequest",
        "unknown epilogue": "BadRequest", "reserve end not int": "BadRequest", "unknown op": "BadRequest"}
    assert "1000000" in errors["out of vocabulary"].message
    assert [(r["id"], r.get("error", {}).get("type")) for r in raw] == \
        [(None, "BadFrame"), (None, "BadRequest"), (None, "BadRequest"), (7, "BadRequest"), (8, None)]
    assert raw[-1]["result"]["model"] == "smollm2-135m-instruct"


def test_a_connection_made_at_a_launch_is_starting_until_its_first_pass(served):
    """The handshake's `starting` puts the connection among the programs whose first pass the
    scheduler's gather waits for; its first pass takes it out, and so does closing. A connection
    without it is never waited for."""
    engine, server = served
    starting, start = engine.scheduler.arrivals.starting, referenced(server)

    async def main():
        async with await EngineClient.connect(*server.address, starting=True) as launched, \
                await EngineClient.connect(*server.address) as plain:
            await plain.info()
            assert len(starting) == 1                  # the launched one, not the plain one
            seq = await launched.create()              # not a pass: still starting
            assert len(starting) == 1
            await launched.forward([{"seq": seq, "tokens": [1, 2, 3]}])
            assert not starting
            closed = await EngineClient.connect(*server.address, starting=True)
            assert len(starting) == 1
            await closed.close()

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while (starting or server.stats()["connections"] or referenced(server) != start) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not starting and referenced(server) == start


def test_closing_a_connection_frees_its_sequences(served):
    engine, server = served
    prompt = engine.tokenizer.encode(PROMPTS[2] * 6)    # several pages
    start = referenced(server)

    async def main():
        closed = await EngineClient.connect(*server.address)
        killed = await EngineClient.connect(*server.address)
        in_flight = []
        for client in (closed, killed):
            seq = await client.create()
            await client.forward([{"seq": seq, "tokens": prompt}])
            child = await client.fork(seq)
            await client.reserve(child, len(prompt) + 40)
            in_flight.append(asyncio.ensure_future(client.forward([{"seq": seq, "tokens": [1, 2, 3]}])))
        assert referenced(server) > start
        await closed.close()
        killed._writer.transport.abort()   # a crash: no orderly close
        # a pass in flight at the close either finished before it or fails with a clear error
        for outcome in await asyncio.gather(*in_flight, return_exceptions=True):
            assert isinstance(outcome, list) or (isinstance(outcome, EngineError) and outcome.type == "ConnectionLost")

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while (server.stats()["connections"] or referenced(server) != start) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert referenced(server) == start and server.stats()["sequences"] == 0
    with engine._lock:
        engine.kv.check()


def test_a_closed_connection_counts_until_its_sequences_are_freed(served, monkeypatch):
    """`connections == 0` in the stats means every page of theirs is back: what callers wait for."""
    engine, server = served
    counted = []
    free = engine.free

    def counting_free(seq):
        counted.append(server.stats()["connections"])
        free(seq)

    monkeypatch.setattr(engine, "free", counting_free)

    async def main():
        client = await EngineClient.connect(*server.address)
        seq = await client.create()
        await client.forward([{"seq": seq, "tokens": engine.tokenizer.encode(PROMPTS[0])}])
        client._writer.transport.abort()     # freed by the server's release, not by a free request

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while not counted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert counted == [1]


def test_pending_calls_fail_when_the_connection_drops():
    """An engine that accepts the connection, reads two requests, then dies without answering."""
    async def engine_that_dies(reader, writer):
        writer.write(wire.pack({"hello": b"n" * wire.NONCE_BYTES}))
        await wire.read_frame(reader)
        writer.write(wire.pack(wire.reply(None, "ready")))
        await wire.read_frame(reader)
        await wire.read_frame(reader)
        writer.close()

    async def main():
        server = await asyncio.start_server(engine_that_dies, "127.0.0.1", 0)
        client = await EngineClient.connect(*server.sockets[0].getsockname()[:2], b"secret")
        outcomes = await asyncio.gather(client.create(), client.info(), return_exceptions=True)
        with pytest.raises(EngineError, match="ConnectionLost: .* closed by the engine"):
            await client.create()
        await client.close()
        server.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert all(isinstance(o, EngineError) and o.type == "ConnectionLost" for o in outcomes)


# waits for a value of a channel nothing puts into, its subscription made before it says so
TAKE_WAITS = """
import asyncio
from inferlet import runtime, session
from inferlet.eta import Channel, dtype

async def main(input):
    if input["restartable"]:
        runtime.declare_restartable()
    never = Channel([1], dtype.i32)
    take = asyncio.ensure_future(never.take_scalar())
    await asyncio.sleep(0)
    session.send("waiting")
    return {"got": await take}
"""
# decodes by a run-ahead, saying each token, its working set holding pages meanwhile
RUN_AHEAD_WAITS = """
from inferlet import model, session
from inferlet.eta import Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics, reduce_argmax, reshape

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    feed = Channel([1], dtype.i32)
    out = Channel([1], dtype.i32).capacity(model.channel_capacity())

    def program():
        token = reshape(reduce_argmax(intrinsics.output(0, "logits")), [1])
        feed.put(token)
        out.put(token)

    first = ForwardPass()
    first.embed(input["prompt"])
    first.state([ws], StateGeometry.folding())
    first.epilogue(program)
    pipe.submit(first)
    tokens = [await out.take_scalar()]
    fwd = ForwardPass()
    fwd.embed(feed)
    fwd.state([ws], StateGeometry.folding())
    fwd.epilogue(program)

    async def on_token():
        tokens.append(await out.take_scalar())
        session.send(str(tokens[-1]))
        return True

    await pipe.run_ahead(fwd, 2000, on_token)
    return {"tokens": tokens}
"""


@pytest.fixture
def closable(default_model_dir):
    """An engine of its own served on a local port, for a test that closes the server: (engine, server)."""
    yield from serve(default_model_dir)


def _run_until_sent(launch: Launch, server: EngineServer) -> tuple[threading.Thread, list]:
    """Start `launch` on `server`'s engine; returns once the run has sent its first message."""
    events, sent = [], threading.Event()

    def emit(event) -> None:
        events.append(event)
        if isinstance(event, (Send, Done, Failed)):
            sent.set()

    thread = Run(launch, server.address, emit).start()
    assert sent.wait(300) and isinstance(events[0], Send), events
    return thread, events


def _pages_back(engine: Engine) -> None:
    with engine._lock:
        engine.kv.check()
        assert engine.kv_stats()["referenced"] == 0


@pytest.mark.parametrize("source", [TAKE_WAITS, RUN_AHEAD_WAITS], ids=["channel_take", "run_ahead"])
def test_a_run_waiting_on_streamed_outputs_fails_at_once_when_the_engine_connection_is_lost(closable, source):
    engine, server = closable
    prompt = engine.tokenizer.encode(PROMPTS[0])
    launch = Launch(Program.load(source), {"prompt": prompt, "restartable": False},
                    limits=RunLimits(timeout_s=600))
    thread, events = _run_until_sent(launch, server)
    server.close()           # the engine's side ends every connection: as an engine that dies would
    thread.join()            # the run's deadline is ten minutes away: it ends by the loss
    end = events[-1]
    assert isinstance(end, Failed) and end.kind == "exception" and not end.restartable, end
    assert re.search(r"the engine connection was lost: the connection to the engine at \S+ was closed by the "
                     "engine", end.message), end.message
    _pages_back(engine)


def test_a_restartable_run_waiting_on_its_engine_says_it_lost_it(closable):
    engine, server = closable
    launch = Launch(Program.load(TAKE_WAITS), {"restartable": True}, limits=RunLimits(timeout_s=600))
    thread, events = _run_until_sent(launch, server)
    server.close()
    thread.join()
    end = events[-1]
    assert isinstance(end, Failed) and end.restartable and end.kind == "cancelled", end
    assert end.message.startswith("the engine connection was lost: "), end.message
    _pages_back(engine)


def test_client_module_does_not_import_torch():
    code = "import sys, pie_actors.inferlet.engine_client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the dummy model ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dummy_home(default_model_dir, tmp_path_factory) -> Path:
    """A PIE_HOME holding the default model (linked) and the dummy model, created by resolve_model."""
    home = tmp_path_factory.mktemp("dummy_home")
    (home / "models").mkdir()
    (home / "models" / default_model_dir.name).symlink_to(default_model_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIE_HOME", str(home))
        model_store.resolve_model("dummy")
    return home


def test_dummy_model_resolves_and_lists(dummy_home, tmp_path, monkeypatch, capsys):
    from pie_actors.gpu.model.loader import load_checkpoint
    from pie_actors.tokenizer import Tokenizer

    monkeypatch.setenv("PIE_HOME", str(dummy_home))
    folder = model_store.resolve_model("dummy")
    assert folder == dummy_home / "models" / "dummy"
    cfg = load_checkpoint(folder).config
    assert (cfg.vocab_size, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (49152, 2, 64, 4, 2)
    text = "Hello, world! <|im_start|>user"
    tok = Tokenizer.from_dir(folder)
    assert tok.decode(tok.encode(text)) == text
    assert pie_main(["model", "list"]) == 0
    assert any(line.startswith("dummy ") for line in capsys.readouterr().out.splitlines())

    # seeded: a second store gets the same weights
    other = tmp_path / "home"
    (other / "models").mkdir(parents=True)
    (other / "models" / "smollm2-135m-instruct").symlink_to(dummy_home / "models" / "smollm2-135m-instruct")
    monkeypatch.setenv("PIE_HOME", str(other))
    digest = lambda f: hashlib.sha256((f / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(model_store.resolve_model("dummy")) == digest(folder)


# ---- Ray --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_local():
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def test_engine_actor_serves_a_client(ray_local, dummy_home):
    from pie_actors.gpu.engine import Engine
    from pie_actors.config import load
    from pie_actors.gpu.engine.actor import start_engine_actor

    folder = dummy_home / "models" / "dummy"
    options = dict(device="cpu", dtype="float32", num_pages=64, compile="off")
    local = Engine.from_model(str(folder), **options)
    prompt = local.tokenizer.encode(PROMPTS[3])
    want = local.generate([prompt], 5, ignore_eos=True)[0]

    actor, address = start_engine_actor(load(model=str(folder), num_threads=1, **options).engine,
                                             name="test-engine")

    async def main():
        async with await EngineClient.connect(*address) as client:
            return (await client.info())["model"], await asyncio.gather(*(decode(client, prompt, 5) for _ in range(4)))

    name, got = asyncio.run(main())
    assert name == "dummy" and got == [want] * 4
    stats = ray_local.get(actor.stats.remote())
    assert sum(stats["batch_sizes"].values()) >= 5 and stats["kv"]["referenced"] == 0
    ray_local.get(actor.close.remote())
    ray_local.kill(actor)
