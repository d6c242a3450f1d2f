"""The documents' inferlet programs, run end to end in one process: the WebAssembly sandbox,
the guest SDK (model, chat, eta), InferletHost and the engine's data-plane server."""
from __future__ import annotations

import threading
import time

import pytest

from pie_actors.inferlet import InferletError
from pie_actors.inferlet.chat_ops import ChatTokens
from pie_actors import RunLimits
from pie_actors.inferlet.model_ops import FRAME_SIZE
from tests.inferlet_helpers import EXAMPLES, referenced, run, settle

QUICKSTART = (EXAMPLES / "quickstart" / "main.py").read_text()
COMPLETION = (EXAMPLES / "completion" / "main.py").read_text()
COMPLETION_MAX = (EXAMPLES / "completion_max" / "main.py").read_text()
# the completion program, returning its tokens too
COMPLETION_TOKENS = COMPLETION.replace('return {"text": model.decode(tokens[-8:])}',
                                       'return {"text": model.decode(tokens[-8:]), "tokens": tokens[-8:]}')
QUESTION = "What is the capital of France?"


def test_chat_pieces_equal_the_rendered_template(runtime):
    engine = runtime.engine
    tok = engine.tokenizer
    source = """
from inferlet import chat, model
async def main(input):
    return {"conv": chat.system(input["a"]) + chat.user(input["b"]) + chat.cue(),
            "nothink": chat.cue_without_thinking(), "cue": chat.cue(),
            "turns": chat.system("s") + chat.user("u") + chat.assistant("r") + chat.user("u2"),
            "prefix": chat.prefix(), "stop": chat.stop_tokens(),
            "model": [model.name(), model.architecture(), model.output_vocab_size(), model.kv_page_size(),
                      model.frame_size(), model.channel_capacity(), model.run_ahead_window()],
            "round": model.decode(model.encode("héllo wörld")),
            "piece": model.decode(model.encode(" héllo wörld"), after=2), "bad_after": bad_after()}

def bad_after():
    try:
        model.decode([1, 2], after=3)
    except Exception as e:
        return str(e)
"""
    out = run(runtime, source, {"a": "You are terse.", "b": QUESTION})
    render = tok.chat_template.render
    sys_a, user_b = {"role": "system", "content": "You are terse."}, {"role": "user", "content": QUESTION}
    assert out["conv"] == tok.encode(render([sys_a, user_b], add_generation_prompt=True))
    turns = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "r"}, {"role": "user", "content": "u2"}]
    assert out["turns"] == tok.encode(render(turns))
    assert out["nothink"] == out["cue"] == tok.encode("<|im_start|>assistant\n")
    assert out["prefix"] == []                      # SmolLM2: add_bos_token is False
    assert set(out["stop"]) == {0, 2} and tok.decode([2]) == "<|im_end|>"
    assert out["model"] == ["smollm2-135m-instruct", "llama", 49152, 16, FRAME_SIZE, RunLimits.channel_capacity,
                            RunLimits.run_ahead_window]
    assert out["round"] == "héllo wörld"
    ids = tok.encode(" héllo wörld")
    assert out["piece"] == tok.decode(ids)[len(tok.decode(ids[:2])):] and out["piece"]
    assert "after=3 is not a count of the 2 ids" in out["bad_after"]
    # the default system message SmolLM2's template inserts never leaks into a user turn
    assert tok.decode(ChatTokens(tok).user("hi")) == "<|im_start|>user\nhi<|im_end|>\n"


def test_quickstart_streams_paris_and_frees_kv(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    sent: list[str] = []
    t0 = time.perf_counter()
    out = run(runtime, QUICKSTART, {"question": QUESTION}, on_send=sent.append)
    took = time.perf_counter() - t0
    assert "Paris" in out["text"], out
    assert "".join(sent) == out["text"] and len(sent) > 1
    settle(runtime, start)

    # measurement (not asserted): the same passes through engine.generate (the reply's tokens and
    # the stop token); noisy on 2 shared cores
    tok = engine.tokenizer
    chat = ChatTokens(tok)
    prompt = chat.system("You are a concise assistant.") + chat.user(QUESTION) + chat.cue_without_thinking()
    n = len(sent)
    t1 = time.perf_counter()
    direct = engine.generate([prompt], n + 1, ignore_eos=True)[0]
    took_direct = time.perf_counter() - t1
    assert tok.decode(direct[:n]) == out["text"] and direct[n] in {0, 2}   # same greedy reply, then stop
    print(f"\nquickstart: {n} tokens + stop; launched {n / took:.1f} tok/s ({took:.2f} s), "
          f"engine.generate {n / took_direct:.1f} tok/s ({took_direct:.2f} s), ratio {took_direct / took:.2f}")


def test_completion_tokens_equal_engine_greedy(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    tok = engine.tokenizer
    prompt = "The capital of France is"
    want = engine.generate([ChatTokens(tok).prefix() + tok.encode(prompt)], 8, ignore_eos=True)[0]
    out = run(runtime, COMPLETION_TOKENS, {"prompt": prompt})
    assert out["tokens"] == want
    assert run(runtime, COMPLETION, {}) == {"text": tok.decode(want)}   # verbatim, default prompt
    settle(runtime, start)


def test_malformed_pass_fails_alone(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    bad = COMPLETION.replace("fwd.embed(tokens[done:])", "fwd.embed(tokens[done:] + [10**9])")
    assert bad != COMPLETION
    want = run(runtime, COMPLETION_MAX, {"prompt": "Water boils at", "max_tokens": 12})
    results: dict = {}

    def good():
        results["good"] = run(runtime, COMPLETION_MAX, {"prompt": "Water boils at", "max_tokens": 12})

    thread = threading.Thread(target=good)
    thread.start()
    with pytest.raises(InferletError) as info:
        run(runtime, bad, {})
    thread.join()
    assert info.value.kind == "exception"
    assert "token id 1000000000 is outside the vocabulary" in info.value.message, info.value
    assert results["good"] == want
    settle(runtime, start)


# Each holds a working set with a prefilled prompt (KV pages in use) when it goes wrong.
_HOLD_PAGES = """
from inferlet import model
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(model.encode("A prompt long enough to hold a few pages of KV. " * 8))
    fwd.state([ws], StateGeometry.folding())
    out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    await out
"""


@pytest.mark.parametrize("kind, tail, limits", [
    ("exception", "    raise RuntimeError('gave up')\n", {}),
    ("timeout", "    while True:\n        pass\n", {"timeout": 3}),
    ("memory", "    hog = []\n    while True:\n        hog.append(bytearray(10**6))\n", {}),
])
def test_a_failing_inferlet_returns_its_pages_while_another_finishes(runtime, kind, tail, limits):
    engine = runtime.engine
    start = referenced(runtime)
    want = run(runtime, COMPLETION_MAX, {"prompt": "Water boils at", "max_tokens": 12})
    results: dict = {}
    thread = threading.Thread(target=lambda: results.update(good=run(
        runtime, COMPLETION_MAX, {"prompt": "Water boils at", "max_tokens": 12})))
    thread.start()
    with pytest.raises(InferletError) as info:
        run(runtime, _HOLD_PAGES + tail, {}, **limits)
    thread.join()
    assert info.value.kind == kind, info.value
    assert results["good"] == want
    settle(runtime, start)


@pytest.mark.parametrize("epilogue, message", [
    ('eta._record("frobnicate", intrinsics.output(0, "logits"))', "op 1 (frobnicate): unknown op"),
    ('reduce_argmax(intrinsics.output(0, "hidden"))', "'hidden'"),
    ('eta.add(intrinsics.output(0, "logits"), eta.constant([1.0, 2.0], "f32"))', "op 2 (add)"),
])
def test_a_bad_epilogue_is_refused_clearly_and_leaks_nothing(runtime, epilogue, message):
    engine = runtime.engine
    start = referenced(runtime)
    source = COMPLETION.replace('reduce_argmax(intrinsics.output(0, "logits"))', epilogue).replace(
        "from inferlet import chat, model", "from inferlet import chat, eta, model")
    with pytest.raises(InferletError) as info:
        run(runtime, source, {})
    assert info.value.kind == "exception" and message in info.value.message, info.value.message
    settle(runtime, start)


def test_concurrent_programs_batch_and_match_alone(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    prompts = ["The capital of France is", "List three colors:", "Once upon a time", "def add(a, b):"]
    inputs = [{"prompt": p, "max_tokens": 6} for p in prompts]
    alone = [run(runtime, COMPLETION_MAX, i) for i in inputs]
    before = dict(engine.batch_sizes)
    results: list = [None] * len(inputs)
    errors: list = []

    def one(i):
        try:
            results[i] = run(runtime, COMPLETION_MAX, inputs[i])
        except Exception as e:   # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == alone
    grew = [size for size, n in engine.batch_sizes.items() if n > before.get(size, 0)]
    assert max(grew) > 1, engine.batch_sizes
    settle(runtime, start)


def test_lanes_and_readout(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    tok = engine.tokenizer
    a, b = tok.encode("The capital of France is"), tok.encode("1, 2, 3, 4,")
    source = """
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax
async def main(input):
    a, b = input["a"], input["b"]
    ws1, ws2, pipe = WorkingSet(), WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(a + b, indptr=[0, len(a), len(a) + len(b)])
    fwd.state([ws1, ws2], StateGeometry.folding())
    fwd.readout([1, len(a) - 1, len(a) + len(b) - 1])      # two rows of lane 0, the last of lane 1
    first = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    fwd2 = ForwardPass()
    fwd2.embed([input["next"]])
    fwd2.state([ws2], StateGeometry.folding())
    second = fwd2.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd2)                      # submitted before the first result came back
    return {"lane0": await first, "lane2": await second, "folded": ws1.folded()}
"""
    [nb] = engine.generate([b], 1, ignore_eos=True)[0:1]
    want0 = [engine.generate([a[:2]], 1, ignore_eos=True)[0][0], engine.generate([a], 1, ignore_eos=True)[0][0]]
    want2 = engine.generate([b], 2, ignore_eos=True)[0][1]
    out = run(runtime, source, {"a": a, "b": b, "next": nb[0]})
    assert out == {"lane0": want0, "lane2": want2, "folded": len(a)}
    settle(runtime, start)


def test_session_receive_gets_client_messages(runtime):
    source = """
from inferlet import session
async def main(input):
    a = await session.receive()
    session.send("got " + a)
    return {"a": a, "b": await session.receive()}
"""
    sent: list[str] = []
    out = run(runtime, source, {}, on_send=sent.append, messages=["one", {"two": 2}])
    assert out == {"a": "one", "b": {"two": 2}} and sent == ["got one"]


def test_binary_data_flows_both_ways(runtime):
    source = """
from inferlet import session
async def main(input):
    data = await session.receive_file()
    session.send_file(data[::-1] + session.file("extra"))
    return {"n": len(data)}
"""
    blob = bytes(range(256)) * 3
    files: list[bytes] = []
    out = run(runtime, source, {}, on_send_file=files.append, files={"extra": b"\x00!"},
              file_messages=[blob])
    assert out == {"n": 768} and files == [blob[::-1] + b"\x00!"]
