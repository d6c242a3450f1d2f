"""Batching across programs: the engine waits for programs it just served (scheduler.Arrivals), so
concurrent one-pass-per-token inferlets share every decode step; a program that waits on something
else leaves the wait at once. Counted from the engine's statistics, never timed."""
from __future__ import annotations

import asyncio
import time

import pytest
from pie_actors import Runtime, Send
from pie_actors.gpu.engine import Lane, PassRequest
from pie_actors.gpu.engine.epilogues import ROWS_EPILOGUES, SIMPLE_EPILOGUES
from pie_actors.gpu.engine.scheduler import Arrivals
from pie_actors.inferlet.engine_client import EngineClient
from tests.engine_helpers import make_engine
from tests.inferlet_helpers import idle_stats

N = 8
TOKENS = 24
ARGMAX = SIMPLE_EPILOGUES["argmax"]
# one pass per token, as the quickstart decodes; it starts decoding when told to, so that all N
# programs begin together and the test is about decode steps, not about launch times
LOCKSTEP = """
from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    tokens = chat.prefix() + model.encode(input["prompt"])
    ws, pipe = WorkingSet(), Pipeline()
    session.send("ready")
    await session.receive()
    done = 0
    for _ in range(input["n"]):
        fwd = ForwardPass()
        fwd.embed(tokens[done:])
        fwd.state([ws], StateGeometry.folding())
        out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await out)
    return {"tokens": tokens[-input["n"]:]}
"""
WAITER = """
from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(chat.prefix() + model.encode("A program that will wait for its client"))
    fwd.state([ws], StateGeometry.folding())
    first = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    await first
    session.send("ready")
    return {"got": await session.receive()}
"""


def _delta(after: dict, before: dict) -> dict[int, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _lockstep(runtime: Runtime, prompts: list[str]) -> tuple[list, dict[int, int]]:
    processes = [runtime.launch(LOCKSTEP, {"prompt": p, "n": TOKENS}) for p in prompts]
    for process in processes:
        assert next(process.events(timeout=60)) == Send("ready")
    before = runtime.stats()["decode_batch_sizes"]
    for process in processes:
        process.send("go")
    results = [p.result(120)["tokens"] for p in processes]
    return results, _delta(idle_stats(runtime)["decode_batch_sizes"], before)


def test_concurrent_one_pass_per_token_programs_share_every_decode_step(runtime):
    prompts = [f"Story {i}: once upon a time, in a country far away, there lived a" for i in range(N)]
    alone = [_lockstep(runtime, [p])[0][0] for p in prompts[:2]]
    _lockstep(runtime, prompts)      # the engine learns how long these hosts take to come back
    together, batches = _lockstep(runtime, prompts)
    assert together[:2] == alone                       # each gets what it gets alone
    tokenizer = runtime.engine.tokenizer
    assert together == runtime.engine.generate([tokenizer.encode(p) for p in prompts], TOKENS, ignore_eos=True)
    steps = sum(batches.values())
    assert batches.get(N, 0) >= 0.9 * steps, batches    # decode steps of all N programs at once


def test_without_the_wait_the_batch_splits(default_model_dir):
    """The control: the same programs with `wait_for_programs` off do not fill their steps."""
    with Runtime.local(str(default_model_dir), dtype="float32", num_pages=256, compile="off",
                       wait_for_programs=False) as runtime:
        prompts = [f"Story {i}: once upon a time, in a country far away, there lived a" for i in range(N)]
        _, batches = _lockstep(runtime, prompts)
        assert runtime.stats()["hold"]["holds"] == 0
    assert batches.get(N, 0) < 0.9 * sum(batches.values()), batches


async def _pass(client: EngineClient, seq: int, tokens: list[int]) -> None:
    await client.forward([{"seq": seq, "tokens": tokens}])


def test_a_program_that_says_it_is_idle_is_not_waited_for(runtime):
    """Program A is answered, then B submits: the engine waits for A (it is expected) unless A
    said it waits on something else. Counted by the scheduler's holds."""
    address = runtime.engine_address

    async def scenario(say_idle: bool) -> dict:
        async with await EngineClient.connect(*address) as a, await EngineClient.connect(*address) as b:
            sa, sb = await a.create(), await b.create()
            await _pass(a, sa, [1, 2, 3])                # A was served: A is expected
            if say_idle:
                a.idle()
            await asyncio.sleep(0.05)
            before = runtime.stats()["hold"]
            await _pass(b, sb, [4, 5, 6])
            return {k: runtime.stats()["hold"][k] - before[k] for k in ("holds", "expired")}

    assert asyncio.run(scenario(say_idle=False))["expired"] == 1     # the step gave up waiting on A
    assert asyncio.run(scenario(say_idle=True)) == {"holds": 0, "expired": 0}


def test_the_wait_policy_gathers_new_programs_and_holds_for_served_ones():
    """Arrivals alone, on a clock the test moves: first passes of new programs wait the bound after
    the first of them; a served program without a pass pending is waited for until it comes, or
    until the bound after the step; one that said it is idle is not; the bound follows the round
    trips measured."""
    arrivals = Arrivals()
    arrivals.served([None], set(), now=0.0, step_s=0.1)       # a step ran, of passes without an owner
    bound = arrivals.bound()
    assert bound == pytest.approx(2 * Arrivals.FIRST_RTT_S)   # none measured: min(2 x 1 ms, half a step)
    arrivals.arrived(1, 1.0)
    assert arrivals.wait_left(1.0, {1: ...}) == pytest.approx(bound)               # gathering
    arrivals.arrived(2, 1.0 + bound / 2)
    assert arrivals.wait_left(1.0 + bound / 2, {1: ..., 2: ...}) == pytest.approx(bound / 2)
    assert arrivals.wait_left(1.0 + bound, {1: ..., 2: ...}) == 0.0                 # the bound has passed
    assert arrivals.stats()["gathers"] == 1 and arrivals.stats()["holds"] == 0

    arrivals.served([1, 2], {2}, now=2.0, step_s=0.1)   # 2 has its next pass pending: only 1 is expected
    assert arrivals.wait_left(2.0, {2: ...}) == pytest.approx(bound)               # a hold, for 1
    arrivals.arrived(1, 2.0 + bound / 4)                 # a round trip of bound / 4
    assert arrivals.wait_left(2.0 + bound / 4, {1: ..., 2: ...}) == 0.0             # all came: no wait left
    arrivals.served([1, 2], set(), now=3.0, step_s=0.1)
    arrivals.idle(1)                                     # 1 awaits its client: not waited for
    arrivals.arrived(2, 3.0 + bound / 4)
    assert arrivals.wait_left(3.0 + bound / 4, {2: ...}) == 0.0
    assert arrivals.bound() == pytest.approx(bound / 2)                              # 2 x the round trips

    arrivals.served([2], set(), now=4.0, step_s=0.1)
    assert arrivals.wait_left(4.0, {3: ...}) == pytest.approx(bound / 2)           # holds for 2 ...
    assert arrivals.wait_left(4.0 + bound, {3: ...}) == 0.0                         # ... until the bound
    assert {k: arrivals.stats()[k] for k in ("gathers", "holds", "expired")} == {"gathers": 1, "holds": 2,
                                                                                  "expired": 1}


def test_the_gather_waits_for_programs_that_connected_and_not_for_a_lone_one():
    """Arrivals alone, on a clock the test moves: a program whose host connected at its launch is
    starting until its first pass (or its idle); first passes wait for starting programs up to a
    step, and go at once when nothing else is on its way."""
    def fresh() -> Arrivals:
        arrivals = Arrivals()
        arrivals.served([None], set(), now=0.0, step_s=0.1)
        return arrivals

    lone = fresh()
    lone.connected(1)
    lone.arrived(1, 1.0)
    assert lone.wait_left(1.0, {1: ...}) == 0.0 and lone.stats()["gathers"] == 0

    three = fresh()
    for owner in (1, 2, 3):
        three.connected(owner)
    three.arrived(1, 1.0)
    assert three.wait_left(1.0, {1: ...}) == pytest.approx(0.1)            # up to a step for 2 and 3
    three.arrived(2, 1.02)
    assert three.wait_left(1.02, {1: ..., 2: ...}) == pytest.approx(0.08)
    three.idle(3)                                                          # 3 awaits its client
    assert three.wait_left(1.03, {1: ..., 2: ...}) == 0.0
    assert three.stats()["gathers"] == 1

    late = fresh()
    late.connected(1)
    late.connected(2)
    late.arrived(1, 1.0)
    assert late.wait_left(1.05, {1: ...}) == pytest.approx(0.05)
    assert late.wait_left(1.1, {1: ...}) == 0.0                            # 2 is a step late: not waited for
    late.arrived(2, 1.3)
    late.forget(2)
    assert late.starting == set()


def _warmed_engine(model_dir):
    engine = make_engine(model_dir, num_pages=64).start()
    warm = engine.create_sequence()     # no owner: times a step, and nobody is expected after it
    engine.submit(PassRequest([Lane(warm, list(range(100, 400)))], epilogue=ARGMAX)).result(120)
    return engine


def _first_passes_of_four_share_one_batch(engine) -> None:
    """Programs 101-104 submit their first passes: the first one's step holds (a gather) until the
    other three have theirs in, and the four prefills run as one batch."""
    arrivals, before = engine.scheduler.arrivals, dict(engine.batch_sizes)
    seqs = [engine.create_sequence() for _ in range(4)]
    futures = [engine.submit(PassRequest([Lane(seqs[0], list(range(10, 20)))], epilogue=ARGMAX, owner=101))]
    deadline = time.monotonic() + 60
    while arrivals.stats()["gathers"] == 0:          # the step is holding for more first passes
        assert time.monotonic() < deadline and not futures[0].done(), "the first pass ran alone"
        time.sleep(0.001)
    futures += [engine.submit(PassRequest([Lane(seq, list(range(20 + i, 30 + i)))], epilogue=ARGMAX,
                                          owner=102 + i)) for i, seq in enumerate(seqs[1:])]
    for future in futures:
        future.result(120)
    assert _delta(engine.batch_sizes, before) == {4: 1}


def test_programs_connected_together_share_their_first_batch_and_a_lone_one_is_not_held(default_model_dir):
    """On the engine: first passes wait for the programs that connected and have not submitted yet,
    and a lone program's first pass runs without a gather."""
    engine = _warmed_engine(default_model_dir)
    try:
        engine.connected(100)
        engine.submit(PassRequest([Lane(engine.create_sequence(), list(range(10, 20)))], epilogue=ARGMAX,
                                  owner=100)).result(120)
        assert engine.scheduler.arrivals.stats()["gathers"] == 0            # alone: not held
        engine.forget(100)                                                   # it ended
        for owner in range(101, 105):
            engine.connected(owner)
        _first_passes_of_four_share_one_batch(engine)
    finally:
        engine.close()


def test_first_passes_of_programs_that_start_together_share_one_batch(default_model_dir, monkeypatch):
    """On the engine: the first pass of a new program that did not connect ahead holds the step for
    others' first passes, so prefills that arrive close together run as one batch. The bound is
    half a step here (a long first step, no round trip measured), so the test's own pace does not
    decide it."""
    monkeypatch.setattr(Arrivals, "FIRST_RTT_S", 10.0)
    engine = _warmed_engine(default_model_dir)
    try:
        arrivals = engine.scheduler.arrivals
        assert arrivals.bound() > 0.02, arrivals.stats()
        _first_passes_of_four_share_one_batch(engine)
        assert arrivals.stats()["gathers"] == 1 and arrivals.stats()["holds"] == 0
    finally:
        engine.close()


def test_an_inferlet_awaiting_a_message_does_not_hold_the_others_back(runtime):
    """The waiter's host tells the engine it is idle as soon as the guest blocks with no pass in
    flight, so the passes of others run without waiting for it."""
    waiter = runtime.launch(WAITER, {})
    assert next(waiter.events(timeout=60)) == Send("ready")
    address = runtime.engine_address

    async def others() -> dict:
        async with await EngineClient.connect(*address) as client:
            seq = await client.create()
            before = runtime.stats()["hold"]
            for token in range(5, 10):
                await _pass(client, seq, [token])
            return {k: runtime.stats()["hold"][k] - before[k] for k in ("holds", "expired")}

    assert asyncio.run(others())["expired"] == 0
    waiter.send("done")
    assert waiter.result(60) == {"got": "done"}


# ---- epilogues run once a batch -------------------------------------------------------------------

def _ir(*ops) -> dict:
    return {"ops": [list(op) for op in ops], "outputs": [len(ops) - 1]}


SCALED = LOCKSTEP.replace('reduce_argmax(intrinsics.output(0, "logits"))',
                          'reduce_argmax(intrinsics.output(0, "logits") / 0.5)')


# the endpoints' device loop: the epilogue picks the token into the next pass's input channel and
# the host's, each program on channels of its own
RUN_AHEAD = """
from inferlet import chat, model, session
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics,
                          reduce_argmax, reshape)

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()
    feed = Channel([1], dtype.i32)
    out = Channel([1], dtype.i32).capacity(model.channel_capacity())

    def program():
        token = reshape(reduce_argmax(intrinsics.output(0, "logits")), [1])
        feed.put(token)
        out.put(token)

    first = ForwardPass()
    first.embed(chat.prefix() + model.encode(input["prompt"]))
    first.state([ws], StateGeometry.folding())
    first.epilogue(program)
    pipe.submit(first)
    tokens = [await out.take_scalar()]
    session.send("ready")
    await session.receive()
    fwd = ForwardPass()
    fwd.embed(feed)
    fwd.state([ws], StateGeometry.folding())
    fwd.epilogue(program)

    async def on_token():
        tokens.append(await out.take_scalar())
        return len(tokens) < input["n"]

    await pipe.run_ahead(fwd, input["n"] + 3 * model.run_ahead_window(), on_token)
    return {"tokens": tokens}
"""


@pytest.mark.parametrize("source", [SCALED, RUN_AHEAD], ids=["row-wise", "own channels"])
def test_one_epilogue_run_serves_a_whole_decode_step(runtime, source):
    """N programs with the same epilogue (row-wise, or the device loop's, which differ only in
    their channels): the engine runs it once a step for all of them, and each gets exactly what
    its own run of the epilogue gives."""
    prompts = [f"Recipe {i}: to bake good bread, first" for i in range(N)]
    alone = _lockstep_with(runtime, source, prompts[:1])[0]
    before = runtime.stats()["row_epilogues"]
    together = _lockstep_with(runtime, source, prompts)
    after = runtime.stats()["row_epilogues"]
    assert together[0] == alone and len(set(map(tuple, together))) > 1
    calls, passes = after.get("calls", 0) - before.get("calls", 0), after.get("passes", 0) - before.get("passes", 0)
    assert calls >= TOKENS - 2 and passes >= 0.9 * N * (TOKENS - 1)   # one run a step, for (nearly) every pass


def _lockstep_with(runtime: Runtime, source: str, prompts: list[str]) -> list:
    processes = [runtime.launch(source, {"prompt": p, "n": TOKENS}) for p in prompts]
    for process in processes:
        assert next(process.events(timeout=60)) == Send("ready")
    for process in processes:
        process.send("go")
    return [p.result(120)["tokens"] for p in processes]


# ---- programs with channels: one run for many passes, each pass's channels its own ------------------

V = 11      # a small vocabulary: the programs' values are checked whole


def _t(i: int) -> dict:
    return {"t": i}


def _channel_programs(c: dict[str, int]) -> dict[str, dict]:
    """The device code of the endpoints' decode loops (greedy, bias and penalties, sampling,
    logprobs), over channels `c` of one pass."""
    return {
        "greedy": {"ops": [["output", [0, "logits"]], ["reduce_argmax", [_t(0)]], ["reshape", [_t(1), [1]]],
                           ["put", [c["feed"], _t(2)]], ["put", [c["out"], _t(2)]]], "outputs": []},
        "greedy, the token put as a number": {"ops": [["output", [0, "logits"]], ["reduce_argmax", [_t(0)]],
                                                      ["put", [c["feed"], _t(1)]], ["put", [c["out"], _t(1)]]],
                                              "outputs": [1]},
        "bias and penalties": {"ops": [
            ["output", [0, "logits"]], ["take", [c["bias"]]], ["put", [c["bias"], _t(1)]], ["add", [_t(0), _t(1)]],
            ["take", [c["counts"]]], ["gt", [_t(4), 0]], ["cast", [_t(5), "f32"]], ["mul", [_t(6), 0.5]],
            ["sub", [_t(3), _t(7)]], ["mul", [_t(4), 0.25]], ["sub", [_t(8), _t(9)]], ["reduce_argmax", [_t(10)]],
            ["reshape", [_t(11), [1]]], ["put", [c["out"], _t(12)]], ["iota", [V, "i64"]], ["eq", [_t(14), _t(12)]],
            ["cast", [_t(15), "f32"]], ["add", [_t(4), _t(16)]], ["put", [c["counts"], _t(17)]]],
            "outputs": [11, 3]},
        "sampling": {"ops": [
            ["output", [0, "logits"]], ["div", [_t(0), 0.7]], ["top_k", [_t(1), 5]], ["softmax", [_t(2)]],
            ["cummass_le", [_t(3), 0.9]], ["mask_apply", [_t(2), _t(4)]], ["softmax", [_t(5)]],
            ["reduce_max", [_t(6)]], ["mul", [_t(7), 0.05]], ["ge", [_t(6), _t(8)]], ["mask_apply", [_t(5), _t(9)]],
            ["take", [c["seed"]]], ["add", [_t(11), 1]], ["put", [c["seed"], _t(12)]],
            ["gumbel_max", [_t(10), _t(11)]], ["reshape", [_t(14), [1]]], ["put", [c["out"], _t(15)]]],
            "outputs": [14, 7]},
        "logprobs": {"ops": [
            ["output", [0, "logits"]], ["reduce_argmax", [_t(0)]], ["log_softmax", [_t(0)]],
            ["reshape", [_t(1), [1]]], ["gather", [_t(2), _t(3)]], ["put", [c["out"], _t(4)]],
            ["constant", [[1.0, 2.0], "f32"]]],
            "outputs": [4, 6]},
    }


def test_a_shared_epilogue_finds_its_rows_around_a_pass_that_reads_out_more(default_model_dir):
    """One batch of three passes with the argmax rows epilogue, one of which reads out two rows: the
    two one-row passes share one run, whether their rows lie side by side or that pass's rows lie
    between them, and each gets the token it gets alone."""
    engine = make_engine(default_model_dir, num_pages=64)      # not started: each step() is one batch
    prompts = [list(range(100 + 10 * i, 108 + 10 * i)) for i in range(3)]

    def batch(order: list[int]) -> dict[int, list]:
        seqs = [engine.create_sequence() for _ in prompts]
        futures = {i: engine.submit(PassRequest([Lane(seqs[i], prompts[i], readout=[6, 7] if i == 1 else None)],
                                                ARGMAX, ROWS_EPILOGUES["argmax"])) for i in order}
        sizes, calls = dict(engine.batch_sizes), engine.row_epilogues["calls"]
        assert engine.step() == len(order)
        assert _delta(engine.batch_sizes, sizes) == {len(order): 1}
        shared = engine.row_epilogues["calls"] - calls
        for seq in seqs:
            engine.free(seq)
        return {i: f.result(0) for i, f in futures.items()} | {"shared": shared}

    alone = {i: batch([i])[i] for i in (0, 2)}
    for order in ([0, 1, 2], [0, 2, 1]):               # rows 0, 3 (a gather) and 0, 1 (a slice)
        together = batch(order)
        assert together["shared"] == 1 and {i: together[i] for i in (0, 2)} == alone, order
    engine.close()


def test_which_programs_run_once_for_many_passes():
    from pie_actors.gpu.eta import compile_program

    c = {"feed": 1, "out": 2, "bias": 3, "counts": 4, "seed": 5}
    logits = ["output", [0, "logits"]]
    lanewise = {
        **_channel_programs(c),
        "argmax": _ir(logits, ("reduce_argmax", [_t(0)])),
        "scaled argmax": _ir(logits, ("constant", [[0.5], "f32"]), ("div", [_t(0), _t(1)]), ("reduce_argmax", [_t(2)])),
        "a reduction used again": _ir(logits, ("reduce_max", [_t(0)]), ("sub", [_t(0), _t(1)])),
    }
    for name, ir in lanewise.items():
        assert compile_program(ir, device="cpu", backend="torch").lanewise, name
    not_lanewise = {
        "a second lane": _ir(("output", [1, "logits"]), ("reduce_argmax", [_t(0)])),
        "two takes of a channel": _ir(("take", [3]), ("take", [3]), ("add", [_t(0), _t(1)])),
        "a take after a put": _ir(logits, ("put", [3, _t(0)]), ("take", [3])),
        "a matmul": _ir(logits, ("matmul", [_t(0), _t(0)])),
        "the row offsets": _ir(("indptr", []), ("cast", [_t(0), "f32"])),
    }
    for name, ir in not_lanewise.items():
        assert not compile_program(ir, device="cpu", backend="torch").lanewise, name
    a, b = (compile_program(_channel_programs(dict(zip(c, ids)))["sampling"], device="cpu")
            for ids in ((1, 2, 3, 4, 5), (21, 22, 23, 24, 25)))
    assert a.hash != b.hash and a.lane_key == b.lane_key      # the same code on other channels: one run


def test_one_run_for_many_passes_equals_each_pass_alone():
    """Each program, run once for 5 passes with their own channels, gives every pass the outputs
    and leaves every channel (queued values and values sent to the host) as 5 runs alone do."""
    import torch

    from pie_actors.gpu.engine.channels import ChannelStore
    from pie_actors.gpu.engine.epilogues import lanes_program_epilogue, program_epilogue
    from pie_actors.gpu.eta import compile_program

    passes = 5
    rows = torch.randn(passes, V, generator=torch.Generator().manual_seed(0))

    def setup(store: ChannelStore, pushed: list) -> list[dict[str, int]]:
        made = []
        for p in range(passes):
            c = {"feed": store.create([1], "i32", 4), "out": store.create([1], "f32", 4),
                 "bias": store.create([V], "f32", 1, [float((p * 7 + i) % 5) for i in range(V)]),
                 "counts": store.create([V], "f32", 1, [float((p + i) % 3) for i in range(V)]),
                 "seed": store.create([1], "i64", 1, [1000 + p])}
            store.subscribe(c["out"], lambda cid, value, error: pushed.append((cid, value, error)))
            made.append(c)
        return made

    def queued(store: ChannelStore, made: list[dict[str, int]]) -> list:
        return [{k: [v.tolist() for v in store.snapshot([cid]).get(cid, [])] for k, cid in c.items()} for c in made]

    for name in _channel_programs({"feed": 1, "out": 2, "bias": 3, "counts": 4, "seed": 5}):
        alone_store, alone_pushed = ChannelStore(torch.device("cpu"), 1 << 20), []
        alone_channels = setup(alone_store, alone_pushed)
        alone = []
        for p, c in enumerate(alone_channels):
            program = compile_program(_channel_programs(c)[name], device="cpu")
            alone.append(program_epilogue(program, [1], alone_store, set(c.values()))(rows[p:p + 1]))
        store, pushed = ChannelStore(torch.device("cpu"), 1 << 20), []
        channels = setup(store, pushed)
        epilogues = [lanes_program_epilogue(compile_program(_channel_programs(c)[name], device="cpu"), store,
                                            set(c.values())) for c in channels]
        assert len({e.key for e in epilogues}) == 1, name
        together = epilogues[0].run(rows, epilogues)
        assert together == alone, name
        assert queued(store, channels) == queued(alone_store, alone_channels), name
        slot = {cid: (p, k) for p, c in enumerate(channels) for k, cid in c.items()}
        alone_slot = {cid: (p, k) for p, c in enumerate(alone_channels) for k, cid in c.items()}
        assert sorted((slot[cid], v) for cid, v, _ in pushed) == sorted((alone_slot[cid], v) for cid, v, _ in alone_pushed)


def test_a_shared_run_that_cannot_finish_puts_nothing_and_a_full_channel_fails_its_pass_only():
    import torch

    from pie_actors.gpu.engine.channels import ChannelStore
    from pie_actors.gpu.engine.epilogues import EpilogueError, lanes_program_epilogue
    from pie_actors.gpu.eta import compile_program

    store = ChannelStore(torch.device("cpu"), 1 << 20)
    channels = [{"feed": store.create([1], "i32", 1), "out": store.create([1], "f32", 1),
                 "seed": store.create([1], "i64", 1, [7])} for _ in range(3)]
    store.take(channels[1]["seed"])                 # pass 1's seed is gone: the shared run cannot take it
    epilogues = [lanes_program_epilogue(compile_program(_channel_programs({"bias": 0, "counts": 0, **c})["sampling"], device="cpu"), store,
                                        set(c.values())) for c in channels]
    with pytest.raises(Exception, match="empty"):
        epilogues[0].run(torch.zeros(3, V), epilogues)
    assert [store.snapshot([c["seed"]])[c["seed"]][0].tolist() for c in (channels[0], channels[2])] == [[7], [7]]
    store.put(channels[1]["seed"], [8])
    greedy = [lanes_program_epilogue(compile_program(_channel_programs({"bias": 0, "counts": 0, **c})["greedy"], device="cpu"), store,
                                     set(c.values())) for c in channels]
    store.put(channels[2]["feed"], [0])             # pass 2's feed is full: its put fails, the others' do not
    results = greedy[0].run(torch.eye(3, V), greedy)
    assert results[:2] == [[], []] and isinstance(results[2], EpilogueError) and "full" in str(results[2])
    assert [store.take(c["feed"]).tolist() for c in channels] == [[0], [1], [0]]
