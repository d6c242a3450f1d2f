"""The launch API: Runtime.local and Runtime.connect give the same processes and events; the
Controller's warm pool, names, messages and kills; engine settings are never reused silently."""
from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from pie_actors import Done, Failed, InferletError, Program, Runtime, Send
from pie_actors.controller import INFERLET_PREFIX, connect
from pie_actors.inferlet.run import sandbox_for

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
QUICKSTART = EXAMPLES / "quickstart" / "main.py"
COMPLETION = (EXAMPLES / "completion" / "main.py").read_text()
PROMPTS = ["The capital of France is", "Water boils at", "The quick brown fox", "My favourite book is"]

WAITER = """
from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe = WorkingSet(), Pipeline()          # hold some KV pages while waiting
    fwd = ForwardPass()
    fwd.embed(chat.prefix() + model.encode("A long wait begins here"))
    fwd.state([ws])
    first = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
    pipe.submit(fwd)
    await first
    session.send("ready")
    return {"got": await session.receive(), "folded": ws.folded()}
"""

SENDER = """
from inferlet import session

async def main(input):
    session.send_to(input["to"], {"from": input["me"]})
    return {"sent": True}
"""


@pytest.fixture(scope="module")
def local(default_model_dir):
    with Runtime.local(str(default_model_dir), dtype="float32", num_pages=256, compile="off") as runtime:
        yield runtime


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    """A Runtime on a Ray cluster of this machine (the Controller starts the engine actor)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    with Runtime.connect(model=str(default_model_dir), dtype="float32", num_pages=256, compile="off") as runtime:
        yield runtime
    ray.shutdown()


@pytest.fixture(params=["local", "cluster"])
def runtime(request):
    return request.getfixturevalue(request.param)


def test_a_long_lived_local_runtime_has_the_tokenizer_its_runs_use_loaded_before_the_first(default_model_dir):
    from pie_actors.inferlet.run_state import model_tokenizer
    model_tokenizer.cache_clear()
    with Runtime.local(str(default_model_dir), long_lived=True, dtype="float32", num_pages=64,
                       compile="off") as runtime:
        assert model_tokenizer.cache_info().currsize == 1         # loaded at start
        encode = "from inferlet import model\nasync def main(input):\n    return model.encode('Hello')\n"
        assert runtime.launch(encode).result()
        info = model_tokenizer.cache_info()
        assert info.misses == 1 and info.hits >= 1, info     # the run found it under the path it is told


def _wait_for(predicate, timeout=60.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _idle(runtime: Runtime) -> dict:
    _wait_for(lambda: runtime.stats()["connections"] == 0 and runtime.stats()["processes"] == 0)
    return runtime.stats()


# ---- the same interface on both ------------------------------------------------------------------

def test_the_same_inferlet_gives_the_same_events_locally_and_on_the_cluster(local, cluster):
    question = {"question": "What is the capital of France?"}
    streams = {name: list(rt.launch(QUICKSTART, question).events()) for name, rt in
               (("local", local), ("cluster", cluster))}
    assert streams["local"] == streams["cluster"]
    *sends, done = streams["local"]
    assert len(sends) > 1 and all(isinstance(e, Send) for e in sends)
    assert isinstance(done, Done) and "Paris" in done.output["text"]
    assert "".join(e.text for e in sends) == done.output["text"]


@pytest.mark.asyncio
async def test_aevents_streams_without_blocking_the_loop(runtime):
    import asyncio

    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    process = runtime.launch(QUICKSTART, {"question": "Name a primary color."})
    events = [event async for event in process.aevents()]
    ticker.cancel()
    assert isinstance(events[-1], Done) and all(isinstance(e, Send) for e in events[:-1])
    assert ticks > 10                                  # the loop kept running while events were awaited
    assert await process.aresult() == events[-1].output


def test_a_failing_inferlet_raises_with_its_traceback(runtime):
    process = runtime.launch("async def main(input):\n    return {'x': input['missing']}\n", {})
    with pytest.raises(InferletError) as info:
        process.result(60)
    assert info.value.kind == "exception" and "KeyError" in info.value.message
    assert "line 2" in info.value.guest_traceback
    assert process.ended and isinstance(list(process.events()), list)


def test_killing_a_process_cancels_it_and_returns_its_pages(runtime):
    start = _idle(runtime)["kv"]["referenced"]
    process = runtime.launch(WAITER, {})
    assert next(process.events(timeout=60)) == Send("ready")
    assert runtime.stats()["kv"]["referenced"] > start
    process.kill()
    events = list(process.events(timeout=60))
    assert len(events) == 1 and isinstance(events[0], Failed) and events[0].kind == "cancelled"
    assert process.name in events[0].message
    stats = _idle(runtime)
    assert stats["kv"]["referenced"] == start and stats["sequences"] == 0


def test_named_processes_take_messages_from_clients_and_each_other(runtime):
    waiter = runtime.launch(WAITER, {}, name="waiter")
    assert waiter.name == "waiter"
    assert next(waiter.events(timeout=60)) == Send("ready")
    with pytest.raises(ValueError, match="already running"):
        runtime.launch(SENDER, {"to": "x", "me": "y"}, name="waiter")
    assert runtime.launch(SENDER, {"to": "waiter", "me": "sender"}).result(60) == {"sent": True}
    result = waiter.result(60)
    assert result["got"] == {"from": "sender"} and result["folded"] > 0
    _idle(runtime)
    with pytest.raises(InferletError, match="no running inferlet named 'waiter'"):
        runtime.launch(SENDER, {"to": "waiter", "me": "late"}).result(60)
    # a message from the launcher, sent before the run has even started
    process = runtime.launch(WAITER, {})
    process.send("from the client")
    assert process.result(60)["got"] == "from the client"


def test_names_and_send_to_are_per_owner(runtime):
    """Two owners may both run an "agent"; send_to from an owner's process finds only its own, and
    another owner's (or the local user's) process of that name does not exist for it."""
    alices, bobs = (runtime.launch(WAITER, {}, name="agent", owner=owner) for owner in ("alice", "bob"))
    for process in (alices, bobs):
        assert process.name == "agent" and next(process.events(timeout=60)) == Send("ready")
    for owner in ("carol", None):
        with pytest.raises(InferletError, match="no running inferlet named 'agent'"):
            runtime.launch(SENDER, {"to": "agent", "me": "x"}, owner=owner).result(60)
    assert runtime.launch(SENDER, {"to": "agent", "me": "bob"}, owner="bob").result(60) == {"sent": True}
    assert bobs.result(60)["got"] == {"from": "bob"}
    alices.send("from alice's client")
    assert alices.result(60)["got"] == "from alice's client"


def test_files_and_bundles_travel_with_the_launch(runtime, tmp_path):
    (tmp_path / "helper.py").write_text("def shout(s):\n    return s.upper()\n")
    (tmp_path / "main.py").write_text("from inferlet import session\nfrom helper import shout\n\n"
                                      "async def main(input):\n"
                                      "    return {'text': shout(session.file('f').decode())}\n")
    program = Program.load(tmp_path)
    assert program.bundle is not None and sandbox_for(program).is_runner    # nothing to build for it
    assert runtime.launch(tmp_path, {}, files={"f": b"quiet"}).result(120) == {"text": "QUIET"}


def test_a_runs_tokens_are_the_rows_the_engine_ran_for_it(runtime):
    """Done.tokens (what the quotas count): the engine's input rows for the run, prompt and
    generated tokens; a second run of the same prompt takes its prefix from the cache and costs less."""
    costs = []
    for _ in range(2):
        before = _idle(runtime)["tokens_computed"]
        process = runtime.launch(COMPLETION, {"prompt": " ".join(PROMPTS * 4)})      # pages to share
        end = list(process.events(timeout=120))[-1]
        assert isinstance(end, Done) and process.tokens == end.tokens
        assert end.tokens == _idle(runtime)["tokens_computed"] - before > 0
        costs.append(end.tokens)
    assert costs[1] < costs[0]


def test_sixteen_concurrent_inferlets_get_their_alone_results(runtime):
    prompts = (PROMPTS * 4)[:16]
    alone = {p: runtime.launch(COMPLETION, {"prompt": p}).result(120) for p in PROMPTS}
    before = sum(runtime.stats()["batch_sizes"].values())
    processes = [runtime.launch(COMPLETION, {"prompt": p}) for p in prompts]
    assert [p.result(120) for p in processes] == [alone[p] for p in prompts]
    stats = _idle(runtime)
    assert max(int(b) for b in stats["batch_sizes"]) > 1 and sum(stats["batch_sizes"].values()) > before
    assert stats["kv"]["referenced"] == 0 and stats["sequences"] == 0


def test_the_runs_of_a_process_share_one_host_loop_thread(local):
    import threading

    processes = [local.launch(COMPLETION, {"prompt": p}) for p in PROMPTS]
    results = ThreadPoolExecutor(len(processes)).map(lambda p: p.result(120), processes)
    most_runs = most_loops = 0
    while not all(p.ended for p in processes):
        names = [t.name for t in threading.enumerate()]
        most_runs, most_loops = max(most_runs, names.count("inferlet")), max(most_loops, names.count("inferlet-host"))
        time.sleep(0.01)
    assert all(r["text"] for r in results)
    assert most_runs > 1 and most_loops == 1


# ---- the Controller and its engines ---------------------------------------------------------------

def test_engine_settings_that_differ_are_refused_with_the_difference(cluster, default_model_dir):
    with pytest.raises(ValueError) as info:
        Runtime.connect(model=str(default_model_dir), dtype="bfloat16", num_pages=256)
    assert "dtype='float32' (asked: 'bfloat16')" in str(info.value)
    with pytest.raises(ValueError, match="num_pages=256 \\(asked: 128\\)"):
        Runtime.connect(model=str(default_model_dir), dtype="float32", num_pages=128, compile="off")
    # the same settings share the running engine
    with Runtime.connect(model=str(default_model_dir), dtype="float32", num_pages=256, compile="off") as again:
        assert again.launch(COMPLETION, {"prompt": PROMPTS[0]}).result(60)["text"]
    status = ray.get(connect().status.remote())
    assert len(status.engines) == 1


def test_launches_go_into_the_free_room_of_started_host_actors(cluster):
    """No launch waits for a new actor process while started ones have room: the host actors after a
    few launches, one at a time and three at once, are those there before, with room kept free."""
    controller = connect()
    cluster.launch(COMPLETION, {"prompt": PROMPTS[0]}).result(60)
    hosts = {n for n in ray.util.list_named_actors() if n.startswith(INFERLET_PREFIX)}
    assert hosts and ray.get(controller.status.remote()).free_room > 0
    cluster.launch(COMPLETION, {"prompt": PROMPTS[1]}).result(60)
    for p in [cluster.launch(COMPLETION, {"prompt": p}) for p in PROMPTS[:3]]:
        p.result(60)
    assert {n for n in ray.util.list_named_actors() if n.startswith(INFERLET_PREFIX)} == hosts


def test_a_late_kill_does_not_reach_the_actors_next_run(cluster):
    """A kill names its process: a run after it in the same actor is not cancelled by it."""
    first = cluster.launch(COMPLETION, {"prompt": PROMPTS[1]})
    first.result(60)
    _wait_for(lambda: not ray.get(connect().status.remote()).processes)
    second = cluster.launch(WAITER, {})
    assert next(second.events(timeout=60)) == Send("ready")
    first.kill()                                       # the same actor may run `second` now
    second.send("still here")
    assert second.result(60)["got"] == "still here"


# ---- the host side stays light --------------------------------------------------------------------

def test_no_host_side_module_imports_torch():
    modules = ["pie_actors", "pie_actors.runtime", "pie_actors.controller", "pie_actors.cli",
               "pie_actors.process", "pie_actors.program", "pie_actors.config", "pie_actors.client",
               "pie_actors.ws_protocol"]
    package = Path(__file__).resolve().parent.parent / "pie_actors" / "inferlet"
    modules += [f"pie_actors.inferlet.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"]
    code = f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_program_load_takes_files_folders_and_source(tmp_path):
    assert Program.load("async def main(input): return {}").source.startswith("async def")
    assert Program.load(QUICKSTART).source == QUICKSTART.read_text()
    (tmp_path / "main.py").write_text("async def main(input):\n    return {}\n")
    assert Program.load(tmp_path).source.startswith("async def")      # a folder with main.py only
    with pytest.raises(FileNotFoundError):
        Program.load(str(tmp_path / "missing.py"))
