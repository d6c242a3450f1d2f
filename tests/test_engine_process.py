"""pie serve with its engine in a child process (`Runtime.local(engine_process=True)`, what `pie serve
--local` and `Server()` run): replies equal the in-process engine's greedy decoding, streamed or not,
saved working sets are listed and deleted through the child, every page returns, and the child's
engine stops serving when the server closes."""
from __future__ import annotations

import socket

import openai
import pytest
from openai import OpenAI

from pie_actors.inferlet.chat_ops import chat_tokens
from pie_actors.serve.auth import owner_of
from serve_helpers import ASK, KEY, idle, start

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(default_model_dir):
    with start(default_model_dir, api_keys=(KEY,), engine_process=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _greedy(runtime, messages: list[dict]) -> str:
    """The in-process engine's greedy reply to `messages` (the reference)."""
    engine = runtime.engine
    tok = engine.tokenizer
    prompt = tok.encode(tok.chat_template.render(messages, add_generation_prompt=True))
    stops = set(chat_tokens(tok).stop_tokens())
    out = engine.generate([prompt], MAX_TOKENS, stop=stops)[0]
    return tok.decode(out[:-1] if out and out[-1] in stops else out)


def test_replies_equal_the_in_process_engines_and_every_page_returns(server, client, runtime):
    start_pages = idle(server)["kv"]["referenced"]
    whole = client.chat.completions.create(model="default", messages=ASK, max_tokens=MAX_TOKENS, temperature=0)
    chunks = client.chat.completions.create(model="default", messages=ASK, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    want = _greedy(runtime, ASK)
    assert whole.choices[0].message.content == streamed == want
    assert whole.usage.completion_tokens <= MAX_TOKENS
    stats = idle(server)
    assert stats["kv"]["referenced"] == start_pages
    assert stats["decode_batch_sizes"]                     # the child's engine did the decoding
    with pytest.raises(AttributeError, match="its own process"):
        server.runtime.engine


def test_saved_sets_go_through_the_child_and_it_stops_with_the_server(default_model_dir):
    owner = owner_of(KEY)
    with start(default_model_dir, api_keys=(KEY,), engine_process=True) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        kept = client.responses.create(model="default", input="Hi.", max_output_tokens=4, temperature=0)
        idle(server)
        assert kept.id in {s["name"] for s in server.runtime.saved(owner)}
        client.responses.delete(kept.id)
        assert kept.id not in {s["name"] for s in server.runtime.saved(owner)}
        with pytest.raises(KeyError):
            server.runtime.delete_saved("no-such-set", owner)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(kept.id)
        assert idle(server)["kv"]["referenced"] == 0
        host, port, _ = server.runtime.engine_address
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=5).close()
