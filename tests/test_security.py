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
import time

import msgpack
import pytest

from pie_actors import Runtime
from pie_actors.gpu.engine import data_plane, wire
from pie_actors.gpu.engine.data_plane import EngineServer
from pie_actors.inferlet.engine_client import EngineClient, EngineError
from tests.engine_helpers import decode, make_engine

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


def released(server: EngineServer) -> dict:
    """The engine's KV pages once the server has released every closed connection's working sets."""
    end = time.monotonic() + 30
    while server.stats()["connections"] and time.monotonic() < end:
        time.sleep(0.01)
    assert server.stats()["connections"] == 0
    return server.engine.kv_stats()


def request_body(op: str = "create", **fields) -> bytes:
    return msgpack.packb(wire.request(1, op, **fields))


def refusal(frames: list[dict]) -> dict:
    """The one frame after the hello, checked to be the Unauthorized error (and nothing else came)."""
    hello, *rest = frames
    assert isinstance(hello["hello"], bytes) and len(hello["hello"]) == wire.NONCE_BYTES
    assert len(rest) == 1 and rest[0]["id"] is None and rest[0]["error"]["type"] == "Unauthorized", rest
    return rest[0]


def test_a_connection_that_does_not_prove_the_secret_is_refused_before_any_request(plane, monkeypatch):
    engine, server = plane
    monkeypatch.setattr(data_plane, "HANDSHAKE_TIMEOUT_S", 0.5)
    want = engine.generate([PROMPT], 3, ignore_eos=True)[0]
    address = server.address

    async def main() -> tuple[list[int], list[int]]:
        # a connection made before the attempts keeps serving through them
        async with await EngineClient.connect(*address) as bystander:
            before = await decode(bystander, PROMPT, 3)
            stats = server.stats()
            pass_body = request_body("pass", lanes=[{"seq": 0, "tokens": PROMPT}], epilogue=wire.ARGMAX)
            silent = raw_frames(address, None)                           # refused at the timeout, which it names
            assert "did not answer the hello within 0.5 s" in refusal(silent)["error"]["message"]
            nonce = silent[0]["hello"]
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
            return before, await decode(bystander, PROMPT, 3)

    before, after = asyncio.run(main())
    assert before == after == want
    assert released(server)["referenced"] == 0


def test_a_connection_acts_only_for_the_owner_it_named(plane):
    """Saved working sets are an owner's: a connection that named another at its handshake gets a
    BadRequest for each request about them, and the set is untouched."""
    engine, server = plane

    async def main() -> None:
        async with await EngineClient.connect(*server.address, owner="a") as a, \
                await EngineClient.connect(*server.address, owner="b") as b:
            seq = await a.create()
            await a.forward([{"seq": seq, "tokens": PROMPT * 5}])
            kept = await a.save(seq, "notes", "a")
            theirs = await b.create()
            for call in (b.saved("a"), b.open("notes", "a"), b.delete_saved("notes", "a"),
                         b.save(theirs, "notes", "a"), b.saved(None)):
                with pytest.raises(EngineError) as refused:
                    await call
                assert refused.value.type == "BadRequest" and "owner" in refused.value.message
            assert await b.saved("b") == []
            assert await a.saved("a") == [{"name": "notes", "state": "kept", "tokens": kept}]
            await a.delete_saved("notes", "a")

    asyncio.run(main())
    assert released(server)["referenced"] == 0


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


# ---- the prefix cache is partitioned; a partition's pages are bounded (the KV store alone) -------

def test_prefix_pages_match_only_within_their_partition():
    from pie_actors.kvstore import KVStore, partition_root

    kv, secret = KVStore(64, page_size=4), b"s" * 32
    a, b = partition_root(secret, "owner-a"), partition_root(secret, "owner-b")
    assert len({a, b, partition_root(secret, None), partition_root(b"t" * 32, "owner-a")}) == 4
    prompt = list(range(13))                         # three full pages and a token to compute

    def prefill(root: int) -> int:
        seq = kv.create(root)
        plan = kv.append(seq, prompt)
        kv.commit(seq, len(prompt))
        kv.free(seq)
        return plan.reused

    assert prefill(a) == 0 and prefill(a) == 12      # the same partition hits: caching is on
    assert prefill(b) == 0 and prefill(b) == 12      # another misses, then has its own copy
    assert prefill(partition_root(secret, None)) == 0
    kv.check()


def test_a_partitions_page_bound_refuses_the_allocation_past_it_and_changes_nothing():
    from pie_actors.kvstore import KVStore, QuotaExceeded

    kv = KVStore(64, page_size=4)
    kv.limit(7, 3)
    seq = kv.create(7)
    kv.append(seq, list(range(8)))                   # two pages
    kv.commit(seq, 8)
    child, _ = kv.fork(seq)                          # shares both: no page more
    kv.append(child, [1, 2, 3])                      # the third
    before = (kv.stats(), kv.length(seq), kv.length(child))
    with pytest.raises(QuotaExceeded, match="hold 3 KV pages; 1 more would pass their bound of 3"):
        kv.append(seq, [9])
    with pytest.raises(QuotaExceeded):
        kv.reserve(kv.create(7), 1)
    assert (kv.stats(), kv.length(seq), kv.length(child)) == before
    other = kv.create(8)                             # another partition is not bounded by it
    kv.append(other, list(range(40)))
    saved, _ = kv.fork(seq, counted=False)           # a saved set is not held by the programs
    kv.free(child)
    kv.append(seq, [9])                              # room again once a page returned
    kv.check()
    for s in (seq, saved, other):
        kv.free(s)
    kv.limit(7, 0)
    assert kv.stats()["referenced"] == 0


def test_tokens_per_minute_count_the_last_minute_only():
    from pie_actors.serve.auth import owner_of
    from pie_actors.serve.errors import ApiError
    from pie_actors.serve.quotas import WINDOW_S, Quotas

    now = [1000.0]
    quotas = Quotas({"default": {"tokens_per_minute": 100}, "big": {"tokens_per_minute": 0}},
                    clock=lambda: now[0])
    small, big = owner_of("small"), owner_of("big")
    with quotas.launching(small):
        pass
    quotas.used(small, 60)
    now[0] += WINDOW_S / 2
    quotas.used(small, 50)
    quotas.used(big, 10**6)
    with pytest.raises(ApiError) as refused:
        with quotas.launching(small):
            pass
    assert refused.value.kind == "rate_limited" and "110 tokens" in refused.value.message
    with quotas.launching(big):                     # its own entry: no bound
        pass
    now[0] += WINDOW_S / 2 + 1                       # the first 60 left the window
    assert quotas.tokens_used(small) == 50
    with quotas.launching(small):
        pass
    assert quotas.refused == {"tokens_per_minute": 1}


def test_a_runs_limits_carry_its_keys_bounds_for_what_it_spawns():
    from pie_actors.config import RunLimits
    from pie_actors.serve.auth import owner_of
    from pie_actors.serve.quotas import Quotas

    quotas = Quotas({"default": {"inferlets": 3, "kv_pages": 64}, "free": {"inferlets": 0, "kv_pages": 0}})
    base = RunLimits()
    bounded = quotas.limits(owner_of("some key"), base)
    assert (bounded.inferlets, bounded.kv_pages) == (3, 64)       # runtime.spawn counts against inferlets
    assert quotas.limits(owner_of("free"), base) == base


# ---- pie serve: partitions, quotas and isolation per key (the official SDKs) ---------------------

A, B, ONE, TOKENS, PAGES = "key-a", "key-b", "key-one-inferlet", "key-few-tokens", "key-few-pages"
WS_TOKENS = "key-few-tokens-by-websocket"
QUOTAS = {"default": {"kv_pages": 256}, ONE: {"inferlets": 1}, TOKENS: {"tokens_per_minute": 20},
          WS_TOKENS: {"tokens_per_minute": 20}, PAGES: {"kv_pages": 4}}


@pytest.fixture(scope="module")
def server(default_model_dir):
    from serve_helpers import start

    with start(default_model_dir, api_keys=(A, B, ONE, TOKENS, WS_TOKENS, PAGES), quotas=QUOTAS) as s:
        yield s


def openai_client(server, key: str):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def ask(server, key: str, question: str, **kw):
    return openai_client(server, key).chat.completions.create(
        model="default", messages=[{"role": "user", "content": question}], temperature=0, **{"max_tokens": 2, **kw})


def cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def test_the_prefix_cache_hits_for_the_same_key_and_misses_for_another(server):
    from serve_helpers import idle

    question = "Name three rivers of Europe and the seas they flow into, in order of their length."
    first_a, second_a = ask(server, A, question), ask(server, A, question)
    assert cached(first_a) == 0 and cached(second_a) >= 32          # caching is on, within a key
    first_b, second_b = ask(server, B, question), ask(server, B, question)
    assert cached(first_b) == 0                                     # another key does not see A's pages
    assert cached(second_b) == cached(second_a)                     # but has its own
    assert first_a.choices[0].message.content == first_b.choices[0].message.content == \
        second_b.choices[0].message.content                         # the same greedy text either way
    assert idle(server)["kv"]["referenced"] == 0


def test_a_key_over_its_inferlets_gets_429_until_one_ends(server):
    import openai

    from pie_actors.client import Client
    from pie_actors.serve.auth import owner_of
    from pie_actors.ws_protocol import RequestError
    from serve_helpers import idle

    stream = ask(server, ONE, "Count from one to fifty.", max_tokens=200, stream=True,
                 extra_body={"ignore_eos": True})
    next(iter(stream))                                              # its inferlet runs
    with pytest.raises(openai.RateLimitError) as refused:
        ask(server, ONE, "Hello")
    assert refused.value.status_code == 429
    assert refused.value.body["type"] == "rate_limit_exceeded" and "inferlets" in refused.value.body["message"]
    with Client(server.url, ONE) as client:                         # the WebSocket: an error frame
        with pytest.raises(RequestError) as ws_refused:
            client.submit("async def main(input):\n    return 1\n")
        assert ws_refused.value.code == "rate_limited"
    assert ask(server, A, "Hello").choices[0].message.content       # other keys are not held back
    stream.close()                                                  # its load drops...
    idle(server)
    assert server.runtime.running(owner_of(ONE)) == 0
    assert ask(server, ONE, "Hello").choices[0].message.content     # ...and the key is served again
    with Client(server.url, ONE) as client:
        assert client.wait(client.submit("async def main(input):\n    return 7\n").id, timeout=60) == 7


def test_a_key_over_its_tokens_per_minute_gets_429_in_each_apis_shape(server):
    import anthropic
    import httpx
    import openai
    from google import genai
    from google.genai import errors

    ask(server, TOKENS, "What is the capital of France?")           # about 40 tokens: past its 20
    with pytest.raises(openai.RateLimitError):
        ask(server, TOKENS, "Hello")
    with pytest.raises(anthropic.RateLimitError):
        anthropic.Anthropic(base_url=server.url, api_key=TOKENS, max_retries=0).messages.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "Hello"}])
    gemini = genai.Client(api_key=TOKENS, http_options={"base_url": server.url, "retry_options": {"attempts": 1}})
    with pytest.raises(errors.ClientError) as gemini_refused:
        gemini.models.generate_content(model="default", contents="Hello")
    assert gemini_refused.value.code == 429
    headers = {"Authorization": f"Bearer {TOKENS}", "x-api-key": TOKENS}
    chat = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}
    bodies = {path: httpx.post(server.url + path, json=body, headers=headers, timeout=60) for path, body in (
        ("/v1/chat/completions", chat), ("/v1/messages", chat),
        ("/v1beta/models/default:generateContent", {"contents": [{"parts": [{"text": "Hello"}]}]}))}
    assert {path: r.status_code for path, r in bodies.items()} == dict.fromkeys(bodies, 429)
    openai_error = bodies["/v1/chat/completions"].json()["error"]
    assert (openai_error["type"], openai_error["code"]) == ("rate_limit_exceeded", "rate_limit_exceeded")
    assert "tokens_per_minute" in openai_error["message"]
    anthropic_error = bodies["/v1/messages"].json()
    assert anthropic_error["type"] == "error" and anthropic_error["error"]["type"] == "rate_limit_error"
    gemini_error = bodies["/v1beta/models/default:generateContent"].json()["error"]
    assert (gemini_error["code"], gemini_error["status"]) == (429, "RESOURCE_EXHAUSTED")
    assert ask(server, B, "Hello").choices[0].message.content       # other keys are not held back


ONE_PASS = """
from inferlet import model
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    tokens = model.encode("The capital of France is Paris, the capital of Italy is Rome, and the capital "
                          "of Spain is Madrid.")
    ws, fwd = WorkingSet(), ForwardPass()
    fwd.embed(tokens)
    fwd.state([ws], StateGeometry.folding())
    out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    Pipeline().submit(fwd)
    await out
    return len(tokens)
"""


def test_a_websocket_process_counts_against_its_keys_tokens_per_minute(server):
    """A program's tokens count whatever door it came in by: here the engine rows of one pass."""
    import openai

    from pie_actors.client import Client
    from pie_actors.ws_protocol import RequestError

    with Client(server.url, WS_TOKENS) as client:
        assert client.wait(client.submit(ONE_PASS).id, timeout=60) > 20     # one pass of more than 20 rows
        with pytest.raises(RequestError) as refused:
            client.submit(ONE_PASS)
        assert refused.value.code == "rate_limited" and "tokens_per_minute" in str(refused.value)
    with pytest.raises(openai.RateLimitError):
        ask(server, WS_TOKENS, "Hello")


def test_a_key_over_its_kv_pages_is_refused_with_429_and_every_page_returns(server):
    import openai

    from serve_helpers import idle

    start = idle(server)["kv"]
    long_question = "Tell me about " + ", ".join(f"city number {i}" for i in range(30))   # > 4 pages
    with pytest.raises(openai.RateLimitError) as refused:
        ask(server, PAGES, long_question)
    assert "kv_pages" in refused.value.body["message"] or "KV pages" in refused.value.body["message"]
    assert ask(server, PAGES, "Hi").choices[0].message.content      # a prompt in its pages is served
    assert ask(server, A, long_question).choices[0].message.content  # and others' long prompts are
    after = idle(server)["kv"]
    assert after["referenced"] == 0 and after["total"] == start["total"]
    assert after["free"] + after["cached"] == after["total"]


def test_metrics_and_saved_sets_name_nothing_of_another_key(server):
    import httpx

    from pie_actors.client import Client

    holder = "from inferlet import session\n\nasync def main(input):\n    return await session.receive()\n"
    saver = ("from inferlet import model\nfrom inferlet.eta import ForwardPass, Pipeline, WorkingSet, "
             "intrinsics, reduce_argmax\n\nasync def main(input):\n    ws, pipe = WorkingSet(), Pipeline()\n"
             "    fwd = ForwardPass()\n    fwd.embed(model.encode('A secret plan of key A'))\n"
             "    fwd.state([ws])\n    done = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, 'logits')))\n"
             "    pipe.submit(fwd)\n    await done\n    return ws.save('plan-of-a')\n")
    with Client(server.url, A) as a, Client(server.url, B) as b:
        a.wait(a.submit(saver).id, timeout=120)
        running = a.submit(holder, name="agent-of-a")
        assert [s["name"] for s in a.saved()] == ["plan-of-a"] and b.saved() == []
        with pytest.raises(Exception, match="no saved working set"):
            b.delete_saved("plan-of-a")
        assert [p["name"] for p in b.ps()] == []
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {B}"}).text
        assert "agent-of-a" not in metrics and "plan-of-a" not in metrics and "pie_kv_pages" in metrics
        running.send("done")
        assert running.result(timeout=60) == "done"
        assert [s["name"] for s in a.saved()] == ["plan-of-a"]      # B's attempt changed nothing
        a.delete_saved("plan-of-a")
