"""The eta surface end to end (sandbox -> host -> engine): compiled epilogues, channels between host
and device and between passes, run-ahead decoding, and bad programs failing cleanly."""
from __future__ import annotations

import pytest

from pie_actors import InferletError, RunLimits, Send
from tests.inferlet_helpers import idle_stats, referenced, run, settle

PROMPT = "The capital of France is"

# One pass per token: the host waits for each token before submitting the next pass.
PER_TOKEN = """
from inferlet import chat, model
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    tokens = chat.prefix() + model.encode(input["prompt"])
    ws, pipe = WorkingSet(), Pipeline()
    done, out = 0, []
    for _ in range(input["n"]):
        fwd = ForwardPass()
        fwd.embed(tokens[done:])
        fwd.state([ws], StateGeometry.folding())
        token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await token)
        out.append(tokens[-1])
    return {"tokens": out, "folded": ws.folded()}
"""

# The loop of the documents' "A loop that stays on the device": the epilogue feeds the next pass.
RUN_AHEAD = """
from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics,
                          reduce_argmax, reshape)

async def main(input):
    prompt = chat.prefix() + model.encode(input["prompt"])
    ws, pipe = WorkingSet(), Pipeline()
    first = ForwardPass()
    first.embed(prompt)
    first.state([ws], StateGeometry.folding())
    token0 = first.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(first)
    tokens = [await token0]

    token_in = Channel.from_([tokens[0]], dtype.i32)
    token_out = Channel([1], dtype.i32).capacity(model.channel_capacity())
    fwd = ForwardPass()
    fwd.embed(token_in, Channel.from_([0, 1], dtype.u32))
    fwd.state([ws], StateGeometry.folding())

    @fwd.epilogue
    def _():
        token = reshape(reduce_argmax(intrinsics.output(0, "logits")), [1])
        token_in.put(token)
        token_out.put(token)

    async def on_token():
        tokens.append(await token_out.take_scalar())
        return len(tokens) < input["n"]

    kept = await pipe.run_ahead(fwd, input["budget"], on_token)
    return {"tokens": tokens, "kept": kept, "folded": ws.folded(), "prompt": len(prompt),
            "next": token_in.take()}
"""


def _run_counting(runtime, source, input):
    """Run and count the requests the run sent to the engine (round trips started)."""
    before = idle_stats(runtime)["requests"]
    out = run(runtime, source, input)
    return out, idle_stats(runtime)["requests"] - before


def test_run_ahead_decodes_the_per_token_tokens_with_a_request_per_window(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    n = 40
    want = engine.generate([engine.tokenizer.encode(PROMPT)], n, ignore_eos=True)[0]
    per_token, per_token_requests = _run_counting(runtime, PER_TOKEN, {"prompt": PROMPT, "n": n})
    ahead, ahead_requests = _run_counting(runtime, RUN_AHEAD, {"prompt": PROMPT, "n": n, "budget": 100})
    assert per_token["tokens"] == want and ahead["tokens"] == want
    # the runs after the last token read were cut off: the working set is what per-token decoding left
    assert ahead["kept"] == n - 1 and ahead["folded"] == per_token["folded"] == ahead["prompt"] + n - 1
    assert ahead["next"] == [want[-1]]          # and the input channel holds the last token read
    # requests per extra token: decoding n more tokens costs n requests one pass at a time, and one
    # per window (the host telling the engine how far it has read) with run-ahead
    _, per_token_more = _run_counting(runtime, PER_TOKEN, {"prompt": PROMPT, "n": 2 * n})
    _, ahead_more = _run_counting(runtime, RUN_AHEAD, {"prompt": PROMPT, "n": 2 * n, "budget": 200})
    assert per_token_more - per_token_requests == n
    assert ahead_more - ahead_requests <= n // RunLimits.run_ahead_window, (ahead_requests, ahead_more)
    settle(runtime, start)


def test_run_ahead_ends_at_its_budget(runtime):
    engine = runtime.engine
    out = run(runtime, RUN_AHEAD, {"prompt": PROMPT, "n": 1000, "budget": 5})
    want = engine.generate([engine.tokenizer.encode(PROMPT)], 6, ignore_eos=True)[0]
    assert out["tokens"] == want and out["kept"] == 5


# RUN_AHEAD whose host pauses after its first read (the channel is read by the host from then on):
# the engine runs the rest of the budget and answers meanwhile, and every value it pushed must still
# be there to read
LATE_READER = RUN_AHEAD.replace("from inferlet import chat, model", "import asyncio\nfrom inferlet import chat, model").replace(
    "    async def on_token():\n", "    async def on_token():\n        if len(tokens) == 2:\n"
                                   "            await asyncio.sleep(input['pause_s'])\n")
assert "pause_s" in LATE_READER and "import asyncio" in LATE_READER     # the edits found their lines


def test_a_run_ahead_that_ends_by_its_budget_while_the_host_pauses_keeps_every_token(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    out = run(runtime, LATE_READER, {"prompt": PROMPT, "n": 6, "budget": 5, "pause_s": 1.0}, timeout=30)
    want = engine.generate([engine.tokenizer.encode(PROMPT)], 6, ignore_eos=True)[0]
    assert out["tokens"] == want and out["kept"] == 5
    settle(runtime, start)


# RUN_AHEAD read `wake_every` tokens a wake, noting each read that had to wait for its value (a read
# whose value is there already is done within one turn of the guest's event loop) and counting the
# host calls the reads make
WAKING = RUN_AHEAD.replace("from inferlet import chat, model", "import asyncio\nfrom collections import Counter\n"
                                                                 "from inferlet import _host, chat, model").replace(
    "async def main(input):\n", "async def main(input):\n    calls, call = Counter(), _host.call\n\n"
    "    def counted(op, args=None):\n        calls[op] += 1\n        return call(op, args)\n    _host.call = counted\n").replace(
    "    async def on_token():\n        tokens.append(await token_out.take_scalar())\n",
    "    async def on_token():\n        read = asyncio.ensure_future(token_out.take_scalar())\n"
    "        await asyncio.sleep(0)\n        waits.append(not read.done())\n        tokens.append(await read)\n").replace(
    "on_token)", "on_token, wake_every=input['wake_every'])").replace(
    "    tokens = [await token0]\n", "    tokens, waits = [await token0], []\n").replace(
    '"next": token_in.take()}', '"next": token_in.take(), "waits": waits, "reads": calls["chan.take_scalar"]}')
assert WAKING.count("waits") == 4 and "wake_every=" in WAKING and "= counted" in WAKING   # the edits found their lines


def test_run_ahead_wakes_its_reader_once_per_wake_every_tokens(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    n, k = 33, RunLimits.run_ahead_window
    want = engine.generate([engine.tokenizer.encode(PROMPT)], n, ignore_eos=True)[0]
    out = run(runtime, WAKING, {"prompt": PROMPT, "n": n, "budget": 100, "wake_every": k})
    assert out["tokens"] == want and out["kept"] == n - 1 and out["next"] == [want[-1]]
    # a read that waits is woken once k values are there, so the k - 1 reads after it find theirs
    assert len(out["waits"]) == n - 1 and sum(out["waits"]) <= -(-(n - 1) // k), out["waits"]
    # every value there is handed over at once: the reads of a burst make a host call or two, not k
    assert out["reads"] <= 2 * -(-(n - 1) // k), out["reads"]
    assert run(runtime, WAKING, {"prompt": PROMPT, "n": n, "budget": 100, "wake_every": 1})["tokens"] == want
    # a run that ends by its budget before k values came wakes the waiting read with what there is
    ended = run(runtime, WAKING, {"prompt": PROMPT, "n": 1000, "budget": 5, "wake_every": k}, timeout=60)
    assert ended["tokens"] == want[:6] and ended["kept"] == 5
    with pytest.raises(InferletError, match="wake_every must be from 1 to"):
        run(runtime, WAKING, {"prompt": PROMPT, "n": n, "budget": 100, "wake_every": k + 1})
    settle(runtime, start)


# Three readers wait on one channel together and one of them is cancelled: the values go, in order,
# to the readers still waiting and to the read after them; the cancelled one takes none with it
READERS = """
import asyncio
from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics,
                          reduce_argmax, reshape)

async def main(input):
    tokens = chat.prefix() + model.encode(input["prompt"])
    ws, pipe, out = WorkingSet(), Pipeline(), Channel([1], dtype.i32).capacity(8)
    readers = [asyncio.ensure_future(out.take_scalar()) for _ in range(3)]
    await asyncio.sleep(0)
    readers[1].cancel()
    done, passes = 0, []
    for _ in range(3):
        fwd = ForwardPass()
        fwd.embed(tokens[done:])
        fwd.state([ws], StateGeometry.folding())

        @fwd.epilogue
        def token():
            chosen = reduce_argmax(intrinsics.output(0, "logits"))
            out.put(reshape(chosen, [1]))
            return chosen
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await token)
        passes.append(tokens[-1])
    read = [await readers[0], await readers[2], await out.take_scalar()]
    return {"passes": passes, "read": read, "cancelled": readers[1].cancelled()}
"""


def test_readers_waiting_together_on_a_channel_get_its_values_in_order(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    out = run(runtime, READERS, {"prompt": PROMPT}, timeout=60)
    assert out["passes"] == engine.generate([engine.tokenizer.encode(PROMPT)], 3, ignore_eos=True)[0]
    assert out["read"] == out["passes"] and out["cancelled"]
    settle(runtime, start)


SAMPLER = """
from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, broadcast, dtype, ge,
                          gumbel_max, intrinsics, reduce_max, select, softmax)

def top_a(logits, vocab, a, rng):
    probs = softmax(logits)
    p_max = reduce_max(probs)
    keep = ge(probs, broadcast(a * p_max * p_max, [vocab]))
    masked = select(keep, logits, broadcast(float("-inf"), [vocab]))
    return gumbel_max(masked, rng)

async def main(input):
    tokens = chat.prefix() + model.encode(input["prompt"])
    vocab = model.output_vocab_size()
    rng = Channel([1], dtype.i64).capacity(64)
    ws, pipe = WorkingSet(), Pipeline()
    done, out = 0, []
    for i in range(input["n"]):
        rng.put([input["seed"] * 1000 + i])              # host -> device
        fwd = ForwardPass()
        fwd.embed(tokens[done:])
        fwd.state([ws], StateGeometry.folding())
        if input["a"] is None:
            token = fwd.epilogue(lambda: gumbel_max(intrinsics.output(0, "logits") / 0.7, rng.take()))
        else:
            token = fwd.epilogue(lambda: top_a(intrinsics.output(0, "logits"), vocab, input["a"], rng.take()))
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await token)
        out.append(tokens[-1])
    return {"tokens": out}
"""


@pytest.mark.parametrize("a", [None, 0.2], ids=["temperature", "top-a"])
def test_seeded_sampling_is_reproducible_and_seed_dependent(runtime, a):
    runs = {seed: run(runtime, SAMPLER, {"prompt": "Once upon a time", "n": 12, "seed": seed, "a": a})
            for seed in (1, 1, 2)}
    again = run(runtime, SAMPLER, {"prompt": "Once upon a time", "n": 12, "seed": 1, "a": a})
    assert again == runs[1]
    assert runs[1] != runs[2]
    stats = runtime.stats()["programs"]
    assert stats["cache_hits"] > 0       # the same IR from another run compiles once per engine


POISON = """
from inferlet import chat, model
from inferlet.eta import Channel, ForwardPass, Pipeline, WorkingSet, dtype, intrinsics, reduce_argmax, reshape

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    empty = Channel([1], dtype.i32)
    out = Channel([1], dtype.i32)
    fwd = ForwardPass()
    fwd.embed(chat.prefix() + model.encode("Hello"))
    fwd.state([ws])

    @fwd.epilogue
    def _():
        out.put(reshape(reduce_argmax(intrinsics.output(0, "logits")), [1]) + empty.take())

    pipe.submit(fwd)
    try:
        await out.take_scalar()
    except Exception as e:
        return {"error": str(e), "folded": ws.folded()}
    return {"error": None}
"""


def test_a_failed_pass_poisons_its_channels_and_the_waiting_host_sees_why(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    out = run(runtime, POISON, {})
    assert "poisoned" in out["error"] and "is empty" in out["error"], out
    assert out["folded"] == 0                 # the failed pass's rows were rolled back
    settle(runtime, start)


@pytest.mark.parametrize("body, message", [
    ("pipe.close()\n    pipe.submit(fwd)", "submit on a closed pipeline"),
    ("fwd.media(0, [])", "text-only"),
    ("fwd.switch(0, 'diffusion', 1)", "no switch 'diffusion'"),
    ("fwd.input(0, 'image', Channel([1]))", "no extra input 'image'"),
    ("fwd.embed(Channel.from_([1.5, 2.0], dtype.f32))\n"
     "    token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, 'logits')))\n"
     "    pipe.submit(fwd)\n    await token", "holds torch.float32 values, not token ids"),
    ("Channel([1], dtype.i32).take()", "is empty"),
    ("Channel([1], 'complex')._h()", "unknown channel dtype 'complex'"),
])
def test_bad_programs_get_clear_errors(runtime, body, message):
    engine = runtime.engine
    start = referenced(runtime)
    source = f"""
from inferlet import model
from inferlet.eta import Channel, ForwardPass, Pipeline, WorkingSet, dtype, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(model.encode("Hi"))
    fwd.state([ws])
    {body}
    return {{}}
"""
    with pytest.raises(InferletError) as info:
        run(runtime, source, {})
    assert message in info.value.message, info.value.message
    settle(runtime, start)


LORA = """
from inferlet import chat, model
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, add, constant, intrinsics, matmul, reduce_argmax

async def main(input):
    tokens = chat.prefix() + model.encode(input["prompt"])
    ws, pipe = WorkingSet(), Pipeline()
    done = 0
    for _ in range(input["n"]):
        fwd = ForwardPass()
        fwd.embed(tokens[done:])
        fwd.state([ws], StateGeometry.folding())
        if input.get("lora"):
            a, b = input["lora"]
            fwd.adapter(input["site"], lambda x, y: add(y, matmul(matmul(x, constant(a, "f32")), constant(b, "f32"))))
        token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await token)
    return {"tokens": tokens[-input["n"]:]}
"""


def test_a_lora_adapter_equals_the_merged_weights_and_stays_private(runtime, default_model_dir):
    import torch

    from tests.engine_helpers import make_engine
    engine = runtime.engine
    start = referenced(runtime)
    g = torch.Generator().manual_seed(0)
    hidden = engine.model_config.hidden_size
    a, b = torch.randn(hidden, 4, generator=g) * 0.2, torch.randn(4, hidden, generator=g) * 0.2
    base = {"prompt": PROMPT, "n": 8, "site": "o"}
    plain = run(runtime, LORA, base)["tokens"]
    adapted = run(runtime, LORA, {**base, "lora": [a.tolist(), b.tolist()]})["tokens"]
    zero = run(runtime, LORA, {**base, "lora": [a.tolist(), (b * 0).tolist()]})["tokens"]
    assert zero == plain and adapted != plain
    # the same low-rank update merged into every layer's o_proj weight
    merged = make_engine(default_model_dir)
    with torch.no_grad():
        for layer in merged.worker.model.layers:
            layer.self_attn.o_proj.weight += (a @ b).T
    want = merged.generate([engine.tokenizer.encode(PROMPT)], 8, ignore_eos=True)[0]
    merged.close()
    assert adapted == want
    # the adapted run's KV did not enter the prefix cache: the plain prompt still gives plain tokens
    assert run(runtime, LORA, base)["tokens"] == plain
    with pytest.raises(InferletError, match="unknown adapter site 'nope'"):
        run(runtime, LORA, {**base, "site": "nope", "lora": [a.tolist(), b.tolist()]})
    with pytest.raises(InferletError, match=r"op 6 \(add\) on shapes \[5, 576\], \[5, 7\]"):
        run(runtime, LORA, {**base, "lora": [a.tolist(), b[:, :7].tolist()]})
    settle(runtime, start)


MASKED = """
from inferlet import chat, model
from inferlet.eta import Channel, ForwardPass, Pipeline, WorkingSet, dtype, intrinsics, masked_argmax
from inferlet.mask import unpack_mask

async def main(input):
    vocab = model.output_vocab_size()
    allowed = input["allowed"]
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    words = [w - (1 << 32) if w >> 31 else w for w in words]      # int32, as matchers give them
    mask = unpack_mask(words, vocab)
    chan = Channel([vocab], dtype.bool).capacity(2)
    chan.put(mask if input["packed"] else list(mask))
    ws, pipe = WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(chat.prefix() + model.encode("The capital of France is"))
    fwd.state([ws])
    token = fwd.epilogue(lambda: masked_argmax(intrinsics.output(0, "logits"), chan.take()))
    pipe.submit(fwd)
    return {"token": await token, "ones": sum(mask)}
"""


@pytest.mark.parametrize("packed", [True, False], ids=["packed-words", "bool-list"])
def test_a_grammar_mask_reaches_the_device_through_a_channel(runtime, packed):
    engine = runtime.engine
    prompt = engine.tokenizer.encode(PROMPT)
    greedy = engine.generate([prompt], 1, ignore_eos=True)[0][0]
    allowed = [5, 31, 32, 49151, 40000]                # word edges and the sign bit of a word
    out = run(runtime, MASKED, {"allowed": allowed, "packed": packed})
    assert out["ones"] == len(allowed) and out["token"] in allowed
    both = run(runtime, MASKED, {"allowed": allowed + [greedy], "packed": packed})
    assert both["token"] == greedy


DROP_AND_FORK = """
import gc
from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, WorkingSet, intrinsics, reduce_argmax

def prefill(pipe, ws, text):
    fwd = ForwardPass()
    fwd.embed(chat.prefix() + model.encode(text))
    fwd.state([ws])
    token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    return token

async def main(input):
    pipe = Pipeline()
    for i in range(input["loops"]):              # each loop's working set is dropped
        ws = WorkingSet()
        await prefill(pipe, ws, f"Working set number {i} holds a long enough prompt " * 6)
        del ws
        gc.collect()
    parent = WorkingSet()
    token = prefill(pipe, parent, "The fork waits for this pass to run " * 4)
    child = parent.fork(pipe)                    # not awaited: fork waits for the pass
    await token
    session.send("ready")
    await session.receive()
    return {"parent": parent.folded(), "child": child.folded()}
"""


def test_dropped_working_sets_return_their_pages_and_fork_waits_for_submitted_passes(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    peaks = {}
    for loops in (1, 6):
        process = runtime.launch(DROP_AND_FORK, {"loops": loops})
        # the drops' frees go out on the run's connection before the parent's pass, so they are done
        # once that pass's token is back and the program says "ready"
        assert next(process.events(timeout=60)) == Send("ready")
        in_use = runtime.stats()["kv"]["referenced"] - start
        process.send("go")
        peaks[loops] = (in_use, process.result(60))
    (one, out_one), (six, out_six) = peaks[1], peaks[6]
    assert one == six > 0                        # six dropped working sets hold no more than one
    assert out_one["child"] == out_one["parent"] == out_six["child"] > 0
    settle(runtime, start)
