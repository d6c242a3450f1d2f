"""Abuse: a hostile inferlet ends with a typed error (InferletError.kind) while a neighbour that
runs at the same time on the same engine gets exactly the tokens it gets alone, and afterwards
every KV page is back (none referenced, free + cached == the pool).

The abuser says "ready" and waits; the neighbour starts, decodes half its tokens and says
"halfway"; then the abuse begins and the neighbour decodes the rest. One runtime on the dummy
model (the default model's tokenizer, an engine step that costs next to nothing) with small limits,
so that each bomb trips fast.
"""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import wasmtime

from pie_actors import InferletError, Process, Runtime, Send
from pie_actors.config import RunLimits
from pie_actors.inferlet import HostApi, Sandbox
from pie_actors.inferlet.host import limit_store
from tests.inferlet_helpers import idle_stats

POOL = 256                 # KV pages of 16 tokens
SETTINGS = dict(num_pages=POOL, max_batch_tokens=64, max_sequences=512, memory_mb=64, message_mb=1,
                timeout_s=30)
BOMB_TIMEOUT = 3.0         # the deadline of the abusers that run until it

NEIGHBOUR = """
from inferlet import model, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    tokens = model.encode("The capital of France is")
    ws, pipe, done = WorkingSet(), Pipeline(), 0
    for i in range(8):
        if i == 4:
            session.send("halfway")
            await session.receive()
        fwd = ForwardPass()
        fwd.embed(tokens[done:])
        fwd.state([ws], StateGeometry.folding())
        out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await out)
    return tokens[-8:]
"""

ABUSER = """
import sys
from inferlet import model, session
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics,
                          reduce_argmax, reshape)

def greedy():
    return reduce_argmax(intrinsics.output(0, "logits"))

def prefill(tokens):
    ws, fwd = WorkingSet(), ForwardPass()
    fwd.embed(tokens)
    fwd.state([ws], StateGeometry.folding())
    out = fwd.epilogue(greedy)
    Pipeline().submit(fwd)
    return ws, out

async def main(input):
    session.send("ready")
    await session.receive()
    session.send("going")
{bomb}
"""


@pytest.fixture(scope="module")
def runtime(default_model_dir):
    """The dummy model (created from the default one on first use) with the small limits above."""
    with Runtime.local("dummy", dtype="float32", compile="off", **SETTINGS) as rt:
        yield rt


@pytest.fixture(scope="module")
def alone(runtime) -> list[int]:
    """The neighbour's tokens when it runs alone."""
    neighbour = runtime.launch(NEIGHBOUR)
    neighbour.send("on")
    return neighbour.result(timeout=60)


def next_message(process: Process) -> str:
    event = next(process.events(timeout=60))
    assert isinstance(event, Send), event
    return event.text


def abuse(runtime: Runtime, bomb: str, timeout: float | None = None, until: str | None = None
          ) -> tuple[list[int], Process]:
    """Run `bomb` (the rest of an abuser's main) while the neighbour is halfway through its decode:
    the neighbour's tokens, and the abuser's process. `until`: the neighbour goes on only once the
    abuser has sent this message."""
    abuser = runtime.launch(ABUSER.format(bomb=textwrap.indent(textwrap.dedent(bomb), "    ")), timeout=timeout)
    assert next_message(abuser) == "ready"
    neighbour = runtime.launch(NEIGHBOUR)
    assert next_message(neighbour) == "halfway"
    abuser.send("go")
    if until is not None:
        assert [next_message(abuser), next_message(abuser)] == ["going", until]
    neighbour.send("on")
    return neighbour.result(timeout=60), abuser


def failure(process: Process) -> InferletError:
    """How the abuser failed, once it got as far as its bomb."""
    events = list(process.events(timeout=60))
    assert isinstance(events[0], Send) and events[0].text == "going", events
    with pytest.raises(InferletError) as info:
        process.result()
    return info.value


def assert_pages_back(runtime: Runtime) -> None:
    kv = idle_stats(runtime)["kv"]
    assert kv["referenced"] == 0 and kv["free"] + kv["cached"] == kv["total"] == POOL, kv
    with runtime.engine._lock:
        runtime.engine.kv.check()


@pytest.mark.parametrize("bomb, kind", [
    ("while True:\n    pass\n", "timeout"),                                     # pure guest compute
    ("x = []\nwhile True:\n    x.append(bytearray(1 << 20))\n", "memory"),      # memory.grow without end
    ("while True:\n    model.encode('spin')\n", "timeout"),                     # a cheap host op, spun
], ids=["infinite_loop", "memory_grow_bomb", "host_call_spin"])
def test_a_bomb_ends_its_own_run_only(runtime, alone, bomb, kind):
    tokens, abuser = abuse(runtime, bomb, timeout=BOMB_TIMEOUT)
    assert tokens == alone
    assert failure(abuser).kind == kind
    assert_pages_back(runtime)


@pytest.mark.parametrize("limit, kind, says", [
    ("", "exception", "RecursionError"),                      # Python's own recursion limit
    ("sys.setrecursionlimit(10 ** 8)", "trap", "call stack"),  # then the C stack's: wasmtime's bound
], ids=["python_limit", "no_python_limit"])
def test_deep_recursion_ends_its_own_run_only(runtime, alone, limit, kind, says):
    bomb = f"""
    {limit}
    def down(n):
        return down(n + 1) + 1
    down(0)
    """
    tokens, abuser = abuse(runtime, bomb)
    assert tokens == alone
    error = failure(abuser)
    assert error.kind == kind and says in error.message, error
    assert_pages_back(runtime)


# A process that runs a sandbox, then joins Ray (a driver that runs a local program first, then a
# cluster's), then meets a guest's trap: the trap must stay the run's, not become the process's SIGILL.
TRAP_AFTER_RAY = r"""
import ray
from pie_actors.inferlet import HostApi, InferletError, Sandbox

sandbox = Sandbox()
sandbox.run("async def main(input):\n    return 1\n", {}, HostApi())
ray.init(address="local", num_cpus=1, include_dashboard=False)
bomb = "import sys\nsys.setrecursionlimit(10 ** 8)\ndef down(n):\n    return down(n + 1) + 1\nasync def main(input):\n    down(0)\n"
try:
    sandbox.run(bomb, {}, HostApi())
except InferletError as e:
    print("run failed:", e.kind)
print("process alive")
"""


def test_a_trap_after_ray_init_in_the_same_process_ends_its_run_only():
    out = subprocess.run([sys.executable, "-c", TRAP_AFTER_RAY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.splitlines()[-2:] == ["run failed: trap", "process alive"]


WAT_TABLE = """
(module
  (table $t 10 funcref)
  (func (export "grow") (param i32) (result i32)
    (table.grow $t (ref.null func) (local.get 0))))
"""


def test_a_huge_table_is_refused():
    # A guest growing a table past limits.table_elements gets -1, as from memory.grow at its limit
    store = wasmtime.Store(wasmtime.Engine())
    limit_store(store, RunLimits(table_elements=1000))
    grow = wasmtime.Instance(store, wasmtime.Module(store.engine, WAT_TABLE), []).exports(store)["grow"]
    assert grow(store, 10 ** 6) == -1
    assert grow(store, 990) == 10                 # the old size: up to the limit is fine
    assert grow(store, 1) == -1
    # and the sandbox sets the limit: a component whose tables exceed it does not instantiate
    sandbox = Sandbox()
    with pytest.raises(InferletError) as info:
        sandbox.run("async def main(input):\n    return 1\n", {}, HostApi(),
                    limits=replace(RunLimits(), table_elements=1000))
    assert info.value.kind == "memory" and "table" in info.value.message
    assert sandbox.run("async def main(input):\n    return 1\n", {}, HostApi()) == 1


def test_a_host_op_that_waits_ends_at_the_deadline(runtime, alone):
    # ws.fork waits for the working set's passes, here a run-ahead that no one reads: time in the
    # host, which the sandbox's epoch deadline does not stop, so the host op ends by the deadline
    bomb = """
    ws, out = prefill(model.encode("Hello there"))
    token_in, token_out = Channel.from_([await out], dtype.i32), Channel([1], dtype.i32).capacity(64)
    step = ForwardPass()
    step.embed(token_in, Channel.from_([0, 1], dtype.u32))
    step.state([ws], StateGeometry.folding())

    @step.epilogue
    def _():
        chosen = reshape(greedy(), [1])
        token_in.put(chosen)
        token_out.put(chosen)

    async def on_token():
        await token_out.take_scalar()
        ws.fork()
        return True

    await Pipeline().run_ahead(step, 1000, on_token)
    """
    tokens, abuser = abuse(runtime, bomb, timeout=BOMB_TIMEOUT)
    assert tokens == alone
    error = failure(abuser)
    assert error.kind == "timeout" and "waiting on the host" in error.message, error
    assert_pages_back(runtime)


def test_a_flood_of_passes_does_not_hold_the_neighbour_back(runtime, alone, monkeypatch):
    # 8 working sets x 20 passes of 16 tokens (none alike: no prefix reuse), 40 full batches of 64
    # tokens. Served in arrival order, a neighbour pass would wait behind all of them; served
    # round-robin, one batch at most.
    engine, submitted = runtime.engine, []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request: (submitted.append(request), submit(request))[1])
    bomb = """
    sets = [WorkingSet() for _ in range(8)]
    pipe, outs = Pipeline(), []
    for i in range(20):
        for j, ws in enumerate(sets):
            fwd = ForwardPass()
            fwd.embed([100 + 20 * j + i] * 16)
            fwd.state([ws], StateGeometry.folding())
            outs.append(fwd.epilogue(greedy))
            pipe.submit(fwd)
    await outs[0]                  # it ran: the other 159 are queued on the engine
    session.send("flooding")
    return len([await out for out in outs])
    """
    tokens, flood = abuse(runtime, bomb, until="flooding")
    assert tokens == alone
    assert flood.result(timeout=60) == 160
    neighbour = submitted[0].owner               # the abuser submits nothing before "go"
    waits = [r.waited for r in submitted if r.owner == neighbour]
    flood_waits = [r.waited for r in submitted if r.owner != neighbour]
    assert len(waits) == 8 and len(flood_waits) == 160
    assert max(waits[4:]) <= 1 and max(flood_waits) >= 10, (waits, max(flood_waits))
    assert_pages_back(runtime)


@pytest.mark.parametrize("length, says", [
    (9000, "beyond the model's context"),        # the dummy model's context is 8,192 tokens
    (6000, "OutOfPages"),                        # within the context, over the pool (4,096 tokens)
], ids=["over_the_context", "over_the_pool"])
def test_a_giant_prompt_fails_alone_and_loses_no_page(runtime, alone, length, says):
    tokens, abuser = abuse(runtime, f"ws, out = prefill([7] * {length})\nawait out\n")
    assert tokens == alone
    error = failure(abuser)
    assert error.kind == "exception" and says in error.message, error
    assert_pages_back(runtime)


@pytest.mark.parametrize("bomb, says", [
    # wide, each fork copying the parent's partial tail page: the pool runs out first
    ("ws, out = prefill([7] * 5)\nawait out\ntree = [ws.fork() for _ in range(1000)]\n", "OutOfPages"),
    # deep, sharing whole pages only: the bound on working sets per run (max_sequences) trips
    ("ws, out = prefill([7] * 16)\nawait out\ntree = [ws]\nfor _ in range(1000):\n    tree.append(tree[-1].fork())\n",
     "at most 512 sequences"),
], ids=["wide", "deep"])
def test_a_fork_tree_of_1000_fails_cleanly(runtime, alone, bomb, says):
    tokens, abuser = abuse(runtime, bomb)
    assert tokens == alone
    error = failure(abuser)
    assert error.kind == "exception" and says in error.message, error
    assert_pages_back(runtime)


@pytest.mark.parametrize("bomb, kind", [
    ("session.send('x' * (2 << 20))\n", "limit"),              # the send import cannot fail: the run ends
    ("session.send_file(b'x' * (1 << 20))\n", "exception"),    # a host call: the guest's HostError
], ids=["send", "send_file"])
def test_an_oversized_session_message_is_refused(runtime, alone, bomb, kind):
    tokens, abuser = abuse(runtime, bomb)
    assert tokens == alone
    error = failure(abuser)
    assert error.kind == kind and "limits.message_mb" in error.message, error
    assert_pages_back(runtime)


def test_a_failed_run_lets_go_of_its_instance(runtime):
    """A failed run's error outlives it (its process keeps it for `result`); its WebAssembly
    instance must not. A wasmtime error's traceback holds the frames the store was given, so an
    InferletError chained to one kept each killed or trapped run's linear memory (~10 MiB) alive."""
    killed = runtime.launch(ABUSER.format(bomb=""))
    assert next_message(killed) == "ready"
    killed.kill()
    looped = runtime.launch(ABUSER.format(bomb="    while True:\n        pass\n"), timeout=BOMB_TIMEOUT)
    assert next_message(looped) == "ready"
    looped.send("go")
    for process, kind in ((killed, "cancelled"), (looped, "timeout")):
        with pytest.raises(InferletError) as info:
            process.result(timeout=60)
        assert info.value.kind == kind
    gc.collect()
    assert [o for o in gc.get_objects() if isinstance(o, wasmtime.Store)] == []
    assert_pages_back(runtime)
