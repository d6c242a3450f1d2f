"""pie serve on a Ray cluster (`Server(local=False)`, what `pie serve` without --local runs): the
engine in its actor, each request an inferlet actor from the Controller's pool. Answers are the
greedy decode of an engine of the same model in this process; concurrent streams share batches; a
client that leaves ends its inferlet, and its KV pages return."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import ray

from pie_actors.controller import NAME, NAMESPACE
from pie_actors.gpu.engine import Engine
from pie_actors.inferlet.chat_ops import chat_tokens
from serve_helpers import ASK, KEY, start

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(default_model_dir):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with start(default_model_dir, local=False, api_keys=(KEY,)) as s:
            yield s
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """Greedy text of a chat on an engine of the same model and dtype, in this process."""
    engine = Engine.from_model(str(default_model_dir), dtype="float32", num_pages=64, compile="off", progress=False)
    tok = engine.tokenizer
    stops = set(chat_tokens(tok).stop_tokens())

    def greedy(messages: list[dict]) -> str:
        prompt = tok.encode(tok.chat_template.render(messages, add_generation_prompt=True))
        out = engine.generate([prompt], MAX_TOKENS, stop=stops)[0]
        return tok.decode(out[:-1] if out and out[-1] in stops else out)

    yield greedy
    engine.close()


def idle(server, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    while (stats := server.runtime.stats())["processes"] or stats["connections"]:
        assert time.monotonic() < end, stats
        time.sleep(0.05)
    return stats


def controller_status():
    return ray.get(ray.get_actor(NAME, namespace=NAMESPACE).status.remote(), timeout=60)


def test_paris_through_the_cluster_streamed_and_not(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    launches = controller_status().launches
    whole = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=MAX_TOKENS)
    chunks = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=MAX_TOKENS,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed == reference(ASK)
    assert "Paris" in streamed
    assert controller_status().launches == launches + 2     # each request an inferlet actor of the pool


def test_concurrent_streams_share_batches_and_a_leaver_ends_its_inferlet(server, reference):
    asks = [[{"role": "user", "content": f"What is {n} times {n}?"}] for n in range(2, 6)]
    expected = [reference(ask) for ask in asks]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

    async def one(ask) -> str:
        stream = await client.chat.completions.create(model="default", messages=ask, temperature=0,
                                                      max_tokens=MAX_TOKENS, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*map(one, asks))

    before = idle(server)
    assert asyncio.run(all_of_them()) == expected
    after = idle(server)
    grew = {int(k): v - before["decode_batch_sizes"].get(k, 0) for k, v in after["decode_batch_sizes"].items()}
    assert max(size for size, n in grew.items() if n > 0) > 1, grew
    # a client that leaves mid-stream: its inferlet actor stops, its pages return
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "default", "messages": ASK, "max_tokens": 4000, "ignore_eos": True,
                            "temperature": 0, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert [next(lines) for _ in range(4)]
    left = idle(server)
    assert left["kv"]["referenced"] == before["kv"]["referenced"]
    assert sum(left["batch_sizes"].values()) - sum(after["batch_sizes"].values()) < 1000
    assert controller_status().processes == []
