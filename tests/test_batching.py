"""Batching across programs: the engine waits for programs it just served (scheduler.Arrivals), so
concurrent one-pass-per-token inferlets share every decode step; a program that waits on something
else leaves the wait at once. Counted from the engine's statistics, never timed."""
from __future__ import annotations

import asyncio
from pie_actors import Runtime, Send
from pie_actors.inferlet.engine_client import EngineClient
from tests.inferlet_helpers import idle_stats

N = 8
TOKENS = 24
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
    assert together == [runtime.engine.generate([runtime.engine.tokenizer.encode(p)], TOKENS,
                                                ignore_eos=True)[0] for p in prompts]
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


def test_which_programs_may_run_once_for_many_passes():
    from pie_actors.gpu.eta import compile_program

    logits = ("output", [0, "logits"])
    cases = {
        "argmax": (_ir(logits, ("reduce_argmax", [{"t": 0}])), True),
        "scaled argmax": (_ir(logits, ("constant", [[0.5], "f32"]), ("div", [{"t": 0}, {"t": 1}]),
                              ("reduce_argmax", [{"t": 2}])), True),
        "log-probabilities": (_ir(logits, ("log_softmax", [{"t": 0}])), True),
        "a reduction used again": (_ir(logits, ("reduce_max", [{"t": 0}]), ("sub", [{"t": 0}, {"t": 1}])), False),
        "a second lane": (_ir(("output", [1, "logits"]), ("reduce_argmax", [{"t": 0}])), False),
        "a channel": (_ir(("take", [3]), ("reduce_argmax", [{"t": 0}])), False),
        "a reshape": (_ir(logits, ("reduce_argmax", [{"t": 0}]), ("reshape", [{"t": 1}, [1]])), False),
    }
    for name, (ir, batchable) in cases.items():
        assert compile_program(ir, device="cpu", backend="torch").batchable == batchable, name


SCALED = LOCKSTEP.replace('reduce_argmax(intrinsics.output(0, "logits"))',
                          'reduce_argmax(intrinsics.output(0, "logits") / 0.5)')


def test_one_epilogue_run_serves_a_whole_decode_step(runtime):
    """N programs with the same (row-wise) epilogue: the engine runs it once a step for all of them,
    and each gets exactly what its own run of the epilogue gives."""
    prompts = [f"Recipe {i}: to bake good bread, first" for i in range(N)]
    alone = _lockstep_with(runtime, SCALED, prompts[:1])[0]
    before = runtime.stats()["row_epilogues"]
    together = _lockstep_with(runtime, SCALED, prompts)
    after = runtime.stats()["row_epilogues"]
    assert together[0] == alone and len(set(map(tuple, together))) > 1
    calls, passes = after.get("calls", 0) - before.get("calls", 0), after.get("passes", 0) - before.get("passes", 0)
    assert calls >= TOKENS - 2 and passes >= 0.9 * N * TOKENS        # one run a step, for (nearly) every pass


def _lockstep_with(runtime: Runtime, source: str, prompts: list[str]) -> list:
    processes = [runtime.launch(source, {"prompt": p, "n": TOKENS}) for p in prompts]
    for process in processes:
        assert next(process.events(timeout=60)) == Send("ready")
    for process in processes:
        process.send("go")
    return [p.result(120)["tokens"] for p in processes]
