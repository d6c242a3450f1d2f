"""pie_actors.client.Client against a running pie serve: a long-lived chat over the WebSocket keeps
its working set between turns (the engine computes only each turn's new tokens), its replies are
those of a fresh greedy run over the whole transcript, and it survives a detach and re-attach."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pie_actors import Done, InferletError, Send
from pie_actors.cli import client_main
from pie_actors.client import Client, Detached, RequestError
from pie_actors.inferlet.chat_ops import chat_tokens
from serve_helpers import KEY, chat_prompt, idle, reference_engine, start

CHAT = Path(__file__).resolve().parent.parent / "examples" / "interactive_chat"
SYSTEM = "You are a helpful assistant."                # the example's default
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is bigger?",
         "Name a river in the first one.", "Thank you!"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(default_model_dir):
    with start(default_model_dir, api_keys=(KEY,)) as s:
        yield s


def test_a_five_turn_chat_computes_only_each_new_turn_and_matches_fresh_greedy_runs(server):
    start_pages = idle(server)["kv"]["referenced"]
    chat = chat_tokens(reference_engine(server).tokenizer)
    client = Client(server.url, KEY)
    process = client.submit(CHAT, {"max_tokens": MAX_TOKENS, "system": SYSTEM}, name="chat", timeout=600)
    events, turns, computed = process.events(timeout=120), [], []
    for number, text in enumerate(TURNS, 1):
        if number == 3:                                # leave, and come back on another connection
            process.detach()
            with pytest.raises(Detached):
                next(events)
            client.close()
            client = Client(server.url, KEY)
            process = client.attach(process.id)
            events = process.events(timeout=120)
        before = server.runtime.stats()["tokens_computed"]
        process.send(text)
        event = next(events)
        assert isinstance(event, Send)
        turns.append(json.loads(event.text))
        computed.append(server.runtime.stats()["tokens_computed"] - before)
    process.send("/bye")
    assert list(events)[-1] == Done({"turns": [{k: v for k, v in t.items() if k != "turn"} for t in turns]})

    # the references: each turn's whole transcript, rendered by the template, decoded greedily
    engine, messages, prompts = reference_engine(server), [{"role": "system", "content": SYSTEM}], []
    for text, turn in zip(TURNS, turns):
        messages.append({"role": "user", "content": text})
        prompts.append(chat_prompt(server, messages))
        messages.append({"role": "assistant", "content": turn["reply"]})
    stops = set(chat.stop_tokens())
    references = [out[:-1] if out[-1] in stops else out for out in engine.generate(prompts, MAX_TOKENS, stop=stops)]
    cut = False
    for number, (text, turn, expected) in enumerate(zip(TURNS, turns, references), 1):
        assert turn["turn"] == number and turn["user"] == text
        assert turn["reply"] == engine.tokenizer.decode(expected), number
        # what the turn is new to the working set: the end of the last reply (its last token when it
        # was cut at MAX_TOKENS), this user turn and the cue; everything before was kept
        opening = chat.system(SYSTEM) if number == 1 else [None] * cut + chat.seal()
        new = len(opening + chat.user(text) + chat.cue_without_thinking())
        assert turn["fed"] == new
        assert turn["folded_before"] == (0 if number == 1 else turns[number - 2]["folded_after"])
        # the engine ran those once, then one row per token the turn chose after its first
        cut = len(expected) == MAX_TOKENS
        assert computed[number - 1] == new + (MAX_TOKENS - 1 if cut else len(expected)), number
    client.close()
    assert idle(server)["kv"]["referenced"] == start_pages


ECHO_FILES = """
from inferlet import session

async def main(input):
    session.send_file(session.file("f") + await session.receive_file())
    return {"attached": len(session.file("f"))}
"""


def test_files_travel_both_ways_and_failures_raise_as_from_the_launch_api(server):
    with Client(server.url, KEY) as client:
        process = client.submit(ECHO_FILES, files={"f": b"\x00\xff"})
        process.send_file(b"ab")
        events = list(process.events(timeout=120))
        assert [type(e).__name__ for e in events] == ["File", "Done"]
        assert events[0].data == b"\x00\xffab" and events[1].output == {"attached": 2}
        failing = client.submit("async def main(input):\n    return {'x': 1 / 0}\n")
        with pytest.raises(InferletError) as info:
            failing.result(120)
        assert info.value.kind == "exception" and "ZeroDivisionError" in info.value.message
        waiting = client.submit("from inferlet import session\n\nasync def main(input):\n"
                                "    return {'got': await session.receive()}\n", detach=True)
        assert [p["process"] for p in client.ps()] == [waiting.id]
        client.send(waiting.id, {"n": 1})
        assert client.wait(waiting.id, timeout=120) == {"got": {"n": 1}}
        assert client.ps() == []


def test_a_javascript_bundle_travels_with_its_modules_and_its_entry(server, tmp_path):
    """A JavaScript bundle folder through the WebSocket: its modules, and the entry package.json names."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "greeting.js").write_text("export const greet = (name) => `hello ${name}`;\n")
    (tmp_path / "app.js").write_text("import { model } from 'inferlet';\nimport { greet } from './lib/greeting.js';\n\n"
                                     "export async function main(input) {\n"
                                     "  return { greeting: greet(input.name), model: model.name() };\n}\n")
    (tmp_path / "package.json").write_text('{"name": "greeter", "version": "0.1.0", "main": "app.js"}')
    with Client(server.url, KEY) as client:
        out = client.submit(tmp_path, {"name": "pie"}).result(120)
        name = client.submit("from inferlet import model\n\nasync def main(input):\n"
                             "    return model.name()\n").result(120)
    assert out == {"greeting": "hello pie", "model": name}


SAVER = """
from inferlet import model
from inferlet.eta import ForwardPass, Pipeline, WorkingSet

async def main(input):
    ws, fwd = WorkingSet(), ForwardPass()
    fwd.embed(model.encode("A conversation worth keeping"))
    fwd.state([ws])
    Pipeline().submit(fwd)
    return {"saved": ws.save("kept")}
"""


def test_saved_working_sets_are_listed_and_deleted_under_their_key(server):
    with Client(server.url, KEY) as client:
        tokens = client.wait(client.submit(SAVER).id, timeout=120)["saved"]
        assert client.saved() == [{"name": "kept", "state": "kept", "tokens": tokens}]
        assert server.runtime.saved(None) == []        # the anonymous scope does not see it
        client.delete_saved("kept")
        assert client.saved() == []
        with pytest.raises(RequestError, match="no saved working set"):
            client.delete_saved("kept")
    assert idle(server)["kv"]["referenced"] == 0


def test_pie_client_lists_and_deletes_saved_sets(server, capsys):
    with Client(server.url, KEY) as client:
        tokens = client.wait(client.submit(SAVER).id, timeout=120)["saved"]
    where = ["--url", server.url, "--api-key", KEY]
    assert client_main(["saved", *where]) == 0
    assert capsys.readouterr().out.splitlines() == ["NAME  STATE  TOKENS", f"kept  kept   {tokens}"]
    assert client_main(["delete-saved", "kept", *where]) == 0
    assert client_main(["saved", *where]) == 0
    assert capsys.readouterr().out.splitlines() == ["NAME  STATE  TOKENS"]
    assert client_main(["delete-saved", "kept", *where]) == 1
    assert capsys.readouterr().err == "pie-client: error: not_found: no saved working set named 'kept'\n"
    assert idle(server)["kv"]["referenced"] == 0
