"""inferlet.runtime.spawn: an inferlet starts other inferlets (source text or a module of its bundle)
through the launch API and awaits their results, locally and on a Ray cluster. Children are
processes of the parent's owner that send_to reaches; they end with their parent unless detached."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import ray

from inferlet_helpers import on_a_cluster, pages_return, reachable
from pie_actors import Done, InferletError, Runtime

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
COMPLETION = (EXAMPLES / "completion" / "main.py").read_text()
SETTINGS = dict(dtype="float32", num_pages=256, compile="off", timeout_s=120)
PROMPTS = ["The capital of France is", "Water boils at", "The quick brown fox"]

PARENT = """
import asyncio
from inferlet import runtime

CHILD = {child!r}

async def main(input):
    children = [await runtime.spawn(CHILD, {{"prompt": p, "max_tokens": 8}}) for p in input["prompts"]]
    results = await asyncio.gather(*(c.result() for c in children))
    return {{"names": [c.name for c in children], "results": results, "me": runtime.name()}}
"""

MESSAGED = """
from inferlet import runtime, session

async def main(input):
    kid = await runtime.spawn("from inferlet import session\\nasync def main(input):\\n"
                              "    sender, message = await session.receive_from()\\n"
                              "    return {'sender': sender, 'message': message, 'input': input}\\n",
                              {"n": 1}, name="kid")
    session.send_to(kid, "hello child")
    return {"name": kid.name, "child": await kid.result()}
"""

WAITS = "from inferlet import session\nasync def main(input):\n    return {'got': await session.receive()}\n"

ABANDONS = f"""
from inferlet import runtime

async def main(input):
    bound = await runtime.spawn({WAITS!r}, name="bound")
    free = await runtime.spawn({WAITS!r}, name="free", detached=True)
    return [bound.name, free.name]
"""

FAILS = """
from inferlet import runtime, HostError

async def main(input):
    child = await runtime.spawn("async def main(input):\\n    raise ValueError('no good')\\n")
    try:
        await child.result()
    except HostError as e:
        return str(e)
"""

REFUSED = """
from inferlet import runtime, HostError

async def main(input):
    try:
        await runtime.spawn(input["program"], node=input.get("node"), model=input.get("model"),
                            name=input.get("name"))
    except HostError as e:
        return str(e)
    return "spawned"
"""

BOUNDED = f"""
from inferlet import runtime, session, HostError

async def main(input):
    first = await runtime.spawn({WAITS!r}, name="first")
    try:
        await runtime.spawn({WAITS!r})
        refused = None
    except HostError as e:
        refused = str(e)
    session.send_to(first, "go")
    return {{"refused": refused, "first": await first.result()}}
"""

NODE = """
from inferlet import runtime

async def main(input):
    child = await runtime.spawn("async def main(input):\\n    return input\\n", {"x": 1}, node=input["node"])
    return await child.result()
"""


@pytest.fixture(scope="module")
def local(default_model_dir):
    with Runtime.local(str(default_model_dir), **SETTINGS) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    with on_a_cluster(model=str(default_model_dir), **SETTINGS) as runtime:
        yield runtime


@pytest.fixture(params=["local", "cluster"])
def runtime(request):
    runtime = request.getfixturevalue(request.param)
    with pages_return(runtime):
        yield runtime


def test_children_from_source_give_the_tokens_of_a_direct_launch(runtime):
    alone = [runtime.launch(COMPLETION, {"prompt": p, "max_tokens": 8}).result(300) for p in PROMPTS]
    out = runtime.launch(PARENT.format(child=COMPLETION), {"prompts": PROMPTS}, name="parent").result(300)
    assert out["results"] == alone and out["me"] == "parent"
    assert len(set(out["names"])) == len(PROMPTS)


def test_a_child_is_reached_by_name_and_knows_its_sender(runtime):
    out = runtime.launch(MESSAGED, {}, name="mother").result(300)
    assert out == {"name": "kid", "child": {"sender": "mother", "message": "hello child", "input": {"n": 1}}}


def test_a_bundle_spawns_its_own_modules(runtime, tmp_path):
    (tmp_path / "helper.py").write_text("def shout(s):\n    return s.upper() + '!'\n")
    (tmp_path / "worker.py").write_text("from helper import shout\n\nasync def main(input):\n"
                                        "    return shout(input['word'])\n")
    (tmp_path / "main.py").write_text(
        "import asyncio\nfrom inferlet import runtime, HostError\n\nasync def main(input):\n"
        "    kids = [await runtime.spawn('worker', {'word': w}) for w in input['words']]\n"
        "    try:\n        await runtime.spawn('nothere')\n    except HostError as e:\n        missing = str(e)\n"
        "    return {'words': await asyncio.gather(*(k.result() for k in kids)), 'missing': missing}\n")
    out = runtime.launch(tmp_path, {"words": ["a", "bc"]}).result(300)
    assert out["words"] == ["A!", "BC!"]
    assert "no module 'nothere'" in out["missing"] and "worker" in out["missing"]


def test_children_end_with_their_parent_unless_detached(runtime):
    assert runtime.launch(ABANDONS, {}).result(300) == ["bound", "free"]
    end = time.monotonic() + 30
    while reachable(runtime, "bound"):           # cancelled when its parent ended
        assert time.monotonic() < end
        time.sleep(0.1)
    assert reachable(runtime, "free", "you may go")   # still running: this message ends it


def test_a_failed_child_fails_its_result_with_its_error(runtime):
    message = runtime.launch(FAILS, {}).result(300)
    assert "failed" in message and "ValueError: no good" in message


def test_spawning_refuses_clearly(runtime):
    def refused(**input):
        return runtime.launch(REFUSED, input).result(300)

    assert "single file, not a bundle" in refused(program="worker")
    other = refused(program="async def main(i): pass", model="other")
    assert "model='other': this runtime serves" in other or "no engine for 'other' runs in this cluster" in other
    holder = runtime.launch(WAITS, {}, name="taken")
    assert "already running" in refused(program="async def main(i): pass", name="taken")
    holder.send("done")
    assert holder.result(300) == {"got": "done"}


def test_a_spawn_past_the_owners_inferlet_bound_is_refused(runtime):
    # the parent and its first child are the owner's two inferlets: the second child is one too many
    limits = dataclasses.replace(runtime.config.limits, inferlets=2)
    out = runtime.launch(BOUNDED, {}, owner="bounded", limits=limits).result(300)
    assert out["first"] == {"got": "go"}
    assert "this owner runs 2 inferlets, its bound" in out["refused"], out


def test_node_placement(local, cluster):
    with pytest.raises(InferletError, match="Runtime.local runs everything in this process"):
        local.launch(NODE, {"node": "anywhere"}).result(300)
    with pytest.raises(InferletError, match="no live node 'nowhere'"):
        cluster.launch(NODE, {"node": "nowhere"}).result(300)
    node = ray.get_runtime_context().get_node_id()
    assert cluster.launch(NODE, {"node": node}).result(300) == {"x": 1}
    ip = ray.util.get_node_ip_address()
    assert cluster.launch(NODE, {"node": ip}).result(300) == {"x": 1}


def test_the_debate_example_runs_its_rounds_by_messages(runtime):
    """examples/agents/debate: three spawned agents, three rounds through send_to / receive_from
    (each side checks every message's sender and round, so a lost or reordered one fails the run),
    then the judge's verdict; the agents kept their working sets across rounds."""
    process = runtime.launch(EXAMPLES / "agents" / "debate", {"rounds": 3, "max_tokens": 6}, name="debate")
    rounds = [e for e in process.events(timeout=300)]
    last = rounds.pop()
    assert isinstance(last, Done), last
    out = last.output
    assert [json.loads(e.text)["round"] for e in rounds] == [1, 2, 3]
    assert out["agents"] == {s: f"debate/{s}" for s in ("for", "against", "undecided")}
    assert [(t["round"], t["stance"]) for t in out["transcript"]] == \
        [(n, s) for n in (1, 2, 3) for s in ("for", "against", "undecided")]
    for done in out["agents_done"]:
        assert done["rounds"] == 3 and len(done["fed"]) == 3
        assert done["folded"] > sum(done["fed"])          # fed only new turns; the rest stayed in the set
