"""Faults on one engine: a batch that fails on the workers (the engine's run of its sixth batch made
to raise, as a worker's failure would) and clients that abort mid-stream. Every program in the failed batch gets the error, every
other one its exact greedy tokens, the page store's books balance afterwards and the next passes
succeed; through pie serve, 90 of 100 concurrent streams get exactly their greedy text while 10 are
cancelled, and at idle no inferlet runs and every page is back."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pie_actors import InferletError, Runtime
from cluster_helpers import GREEDY
from inferlet_helpers import settle
from serve_helpers import KEY, chat_prompt, greedy_text, idle, start

PROMPTS = [f"Count from {n} to {n + 5}:" for n in range(1, 7)]
FAIL_BATCH = 6             # past the prefills, in the middle of the decode


def outcome(process) -> dict | str:
    try:
        return process.result(timeout=120)
    except InferletError as e:
        return e.message


def fail_batch(engine, n: int) -> None:
    """The engine's `n`-th batch fails on its workers: every pass in it gets the error."""
    run = engine._broadcast_and_run

    def run_or_fail(plan):
        if engine.batches_run == n:
            raise RuntimeError(f"injected fault: batch {n} failed")
        return run(plan)

    engine._broadcast_and_run = run_or_fail


def test_a_failed_batch_fails_its_passes_only_and_the_next_passes_succeed(default_model_dir):
    with Runtime.local(str(default_model_dir), dtype="float32", num_pages=256, timeout_s=120, compile="off") as rt:
        fail_batch(rt.engine, FAIL_BATCH)
        start_pages = rt.stats()["kv"]["referenced"]
        tok = rt.engine.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS]
        processes = [rt.launch(GREEDY, {"prompt": p, "n": 8}) for p in prompts]
        first = [outcome(p) for p in processes]
        assert rt.engine.batches_run >= FAIL_BATCH
        failed = [o for o in first if isinstance(o, str)]
        assert failed, first                                  # the batch held some of them
        assert all("injected fault: batch 6 failed" in message for message in failed), failed
        settle(rt, start_pages)                               # the failed batch's pages are rolled back and freed
        # the next passes succeed, and each program's tokens are the engine's greedy decode
        expected = [{"tokens": t} for t in rt.engine.generate(prompts, 8, ignore_eos=True)]
        again = [rt.launch(GREEDY, {"prompt": p, "n": 8}) for p in prompts]
        assert [p.result(timeout=120) for p in again] == expected
        assert [o for o in first if not isinstance(o, str)] == [e for e, o in zip(expected, first)
                                                               if not isinstance(o, str)]
        settle(rt, start_pages)


# ---- 100 streams through pie serve, 10 cancelled mid-stream -------------------------------------

STREAMS, CANCELLED, MAX_TOKENS = 100, 10, 12


@pytest.fixture(scope="module")
def server(default_model_dir):
    # the engine in this process: the tests check its KV pool's own invariants (kv.check)
    with start(default_model_dir, api_keys=(KEY,), num_pages=1024, engine_process=False) as s:
        yield s


def test_100_streams_with_10_cancelled_mid_stream_the_rest_exact_and_nothing_left(server):
    asks = [[{"role": "user", "content": f"Write the number {n} in words."}] for n in range(10)]
    expected = [greedy_text(server, chat_prompt(server, ask), MAX_TOKENS) for ask in asks]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    cancelled = set(range(5, STREAMS, STREAMS // CANCELLED))

    async def one(i: int) -> str | None:
        stream = await client.chat.completions.create(model="default", messages=asks[i % 10], temperature=0,
                                                      max_tokens=MAX_TOKENS, stream=True)
        text = ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if i in cancelled and text:
                await stream.close()                      # the connection closes mid-stream
                return None
        return text

    async def all_of_them() -> list[str | None]:
        return await asyncio.gather(*map(one, range(STREAMS)))

    before = idle(server)
    with ThreadPoolExecutor(1) as pool:                   # the server's loop is its own; keep the test's apart
        texts = pool.submit(asyncio.run, all_of_them()).result(timeout=600)
    assert [i for i, t in enumerate(texts) if t is None] == sorted(cancelled)
    assert all(t == expected[i % 10] for i, t in enumerate(texts) if t is not None)
    after = idle(server)                                  # no process runs, no connection is open
    assert after["processes"] == 0
    assert after["kv"]["referenced"] == before["kv"]["referenced"]
    with server.runtime.engine._lock:
        server.runtime.engine.kv.check()
