"""pie serve's engine process killed mid-stream (as the kernel's OOM killer would): the open stream
ends with an error naming the death, /health answers 503 until another engine serves, a request
made meanwhile waits for it and gets the reference's tokens, and a program that declared itself
restartable runs again on the new engine; /metrics says the engine is down meanwhile. An engine that
dies again young is started again after a longer wait."""
from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import wait

import httpx
import openai
import pytest
from openai import OpenAI

from pie_actors import Runtime
from pie_actors.gpu.engine import engine_process
from pie_actors.inferlet.chat_ops import chat_tokens
from pie_actors.process import Done, Send
from serve_helpers import ASK, KEY, idle, start

MAX_TOKENS = 12
# prefills its prompt, says which token comes next and waits for a message: its working set holds
# KV pages of the engine meanwhile
HOLDER = """
from inferlet import runtime, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    runtime.declare_restartable()
    ws, pipe = WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(input["prompt"])
    fwd.state([ws], StateGeometry.folding())
    out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    token = await out
    session.send(str(token))
    got = await session.receive()
    pipe.close()
    return {"token": token, "got": got}
"""


def _reference(runtime, messages: list[dict]) -> tuple[list[int], str]:
    """The prompt of `messages` and the in-process engine's greedy reply to it (the reference)."""
    engine = runtime.engine
    tok = engine.tokenizer
    prompt = tok.encode(tok.chat_template.render(messages, add_generation_prompt=True))
    stops = set(chat_tokens(tok).stop_tokens())
    out = engine.generate([prompt], MAX_TOKENS, stop=stops)[0]
    return prompt, tok.decode(out[:-1] if out and out[-1] in stops else out)


def _engine_process() -> multiprocessing.Process:
    [child] = [p for p in multiprocessing.active_children() if p.name == "pie-engine"]
    return child


def test_a_killed_engine_process_ends_its_streams_and_another_serves(default_model_dir, runtime):
    prompt, want = _reference(runtime, ASK)
    first_token = runtime.engine.generate([prompt], 1)[0][0]
    with start(default_model_dir, api_keys=(KEY,), engine_process=True) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        holder = server.runtime.launch(HOLDER, {"prompt": prompt})
        events = holder.events(timeout=300)
        assert next(events) == Send(str(first_token))
        child = _engine_process()

        stream = client.chat.completions.create(model="default", messages=ASK, max_tokens=200, temperature=0,
                                                stream=True)
        chunks = iter(stream)
        next(chunks)                                          # the stream is open, its run decoding
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match=r"the engine process died \(exit code -9\)"):
            for _ in chunks:
                pass
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json() == {
            "status": "restarting", "error": "the engine process died (exit code -9)"}
        down = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert down.status_code == 200
        assert "pie_engine_up 0" in down.text.splitlines() and "pie_kv_pages" not in down.text

        # made while no engine serves: it waits for the next one
        whole = client.chat.completions.create(model="default", messages=ASK, max_tokens=MAX_TOKENS, temperature=0)
        assert whole.choices[0].message.content == want
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert _engine_process().pid != child.pid
        up = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
        assert {"pie_engine_up 1", "pie_engine_restarts_total 1"} <= set(up.splitlines()) and "pie_kv_pages" in up

        # the restartable program ran again from its start, on the new engine
        assert next(events) == Send(str(first_token))
        holder.send("go on")
        *_, end = events
        assert end == Done({"token": first_token, "got": "go on"}, end.tokens)
        assert idle(server)["kv"]["referenced"] == 0          # the new engine's pages, every one returned


# one greedy token after the prompt
NEXT_TOKEN = """
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(input["prompt"])
    fwd.state([ws], StateGeometry.folding())
    out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    return {"token": await out}
"""


def _kill_engine(local: Runtime) -> None:
    """Kill the engine's process, as the OOM killer would, and return once its death is seen."""
    restarting = local._backend.restarting
    engine = restarting.engine
    engine.kill()
    wait([engine.sentinel])
    assert restarting.died(engine.address) == "the engine process died (exit code -9)"
    assert local.engine_down is not None


def test_an_engine_that_dies_young_again_is_started_after_a_longer_wait(default_model_dir, runtime, monkeypatch):
    monkeypatch.setattr(engine_process, "STEADY_S", 1e9)        # every engine here dies young
    prompt = runtime.engine.tokenizer.encode("The capital of France is")
    [want] = runtime.engine.generate([prompt], 1)[0]
    with Runtime.local(str(default_model_dir), dtype="float32", num_pages=256, timeout_s=300, compile="off",
                       engine_process=True) as local:
        _kill_engine(local)
        local._backend.restarting.serving(300)
        _kill_engine(local)                                        # dies again at once
        # launched while no engine serves: it waits for the next one
        assert local.launch(NEXT_TOKEN, {"prompt": prompt}).result(timeout=300) == {"token": want}
        assert local.engine_down is None and local.engine_restarts == 2
        assert local._backend.restarting.backoffs == [1.0, 2.0]   # the second wait doubled the first
