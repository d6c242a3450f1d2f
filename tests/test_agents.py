"""The agent examples (examples/agents/) on two Ray nodes of this machine with an engine replica
on each (the two-node Cluster of test_cluster.py, one for the module): every example's processes
ran on both nodes (the replicas' "local" choices: a process uses its own node's engine), its
numbered messages arrived in order with none lost, and both engines' KV pages came back. Greedy
tokens are checked against the engine's own greedy decode where that is cheap."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import Counter
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator
from urllib.parse import parse_qs, urlparse

import pytest
import ray

from inferlet_helpers import EXAMPLES
from pie_actors import Done, Runtime, Send
from pie_actors.gpu.engine import Engine
from cluster_helpers import two_nodes, until
from pie_actors.replicas import ENGINE_PREFIX

AGENTS = EXAMPLES / "agents"


class _Tool(BaseHTTPRequestHandler):
    """The lookup tool: GET /lookup?city=X&delay_ms=N answers {"city", "population"} after N ms."""
    calls: list[dict] = []

    def do_GET(self):
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path != "/lookup" or "city" not in query:
            self.send_error(404)
            return
        time.sleep(int(query.get("delay_ms", 0)) / 1000)
        type(self).calls.append(query)
        body = json.dumps({"city": query["city"], "population": 1000 * len(query["city"])}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, str]]:
    """Node ids by letter: "a" (the head) and "b"."""
    with two_nodes() as (_, ids, _):
        yield ids


@pytest.fixture(scope="module")
def tool():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Tool)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def runtime(nodes, default_model_dir) -> Iterator[Runtime]:
    with Runtime.connect(model=str(default_model_dir), device="cpu", dtype="float32", compile="off",
                         num_pages=256, num_threads=1, replicas=2, timeout_s=300) as rt:
        yield rt


@pytest.fixture(scope="module")
def direct(default_model_dir) -> Iterator[Engine]:
    engine = Engine.from_model(str(default_model_dir), device="cpu", dtype="float32", compile="off", num_pages=64)
    yield engine
    engine.close()


def _engines(model: str) -> list:
    return [ray.get_actor(n) for n in sorted(ray.util.list_named_actors()) if n.startswith(ENGINE_PREFIX)
            and n.endswith(":" + model)]


def _chosen(runtime: Runtime) -> list[Counter]:
    """Launches by each replica, counted by why it was chosen ("local": the process's own node's)."""
    return [Counter(r["chosen"]) for r in runtime.stats()["replicas"]]


def _kv(engines: list) -> list[tuple[int, int]]:
    """Each engine's (referenced, free + cached) pages."""
    return [(s["kv"]["referenced"], s["kv"]["free"] + s["kv"]["cached"])
            for s in ray.get([e.stats.remote() for e in engines])]


def _computed(engines: list) -> int:
    return sum(s["tokens_computed"] for s in ray.get([e.stats.remote() for e in engines]))


@contextmanager
def on_both_nodes(runtime: Runtime) -> Iterator[list]:
    """Around an example's run: its processes used both replicas as their own node's (so they ran
    on both nodes), and once they all ended both engines' pages are where they started. Yields
    the engines."""
    engines = _engines(runtime.config.engine.model)
    assert len(engines) == 2
    until(lambda: runtime.stats()["processes"] == 0)
    start, before = _kv(engines), _chosen(runtime)
    yield engines
    until(lambda: runtime.stats()["processes"] == 0 and _kv(engines) == start, timeout=60)
    chosen = [c - b for c, b in zip(_chosen(runtime), before)]
    assert all(c["local"] > 0 for c in chosen), chosen


def _limits(runtime: Runtime):
    return dataclasses.replace(runtime.config.limits, allow_hosts=("127.0.0.1",))


def _sent(process) -> tuple[list, dict]:
    """The JSON messages a process sent its client, and its output."""
    events = list(process.events(timeout=300))
    assert isinstance(events[-1], Done) and all(isinstance(e, Send) for e in events[:-1]), events[-1]
    return [json.loads(e.text) for e in events[:-1]], events[-1].output


def test_debate_agents_argue_by_messages_across_nodes(runtime, nodes):
    with on_both_nodes(runtime):
        rounds, out = _sent(runtime.launch(AGENTS / "debate", {"rounds": 3, "max_tokens": 4,
                                                               "nodes": [nodes["a"], nodes["b"]]}, name="debate"))
    assert [r["round"] for r in rounds] == [1, 2, 3]                # each side checks sender and round
    assert [(t["round"], t["stance"]) for t in out["transcript"]] == \
        [(n, s) for n in (1, 2, 3) for s in ("for", "against", "undecided")]
    assert all(d["rounds"] == 3 and d["folded"] > sum(d["fed"]) for d in out["agents_done"])


def test_map_reduce_workers_on_both_nodes_stream_their_summaries_in_order(runtime, nodes, direct):
    with on_both_nodes(runtime):
        out = runtime.launch(AGENTS / "map_reduce", {"workers": 3, "max_tokens": 6,
                                                     "nodes": [nodes["a"], nodes["b"]]},
                             name="mr").result(300)
    done = out["workers_done"]
    assert [d["index"] for d in done] == [0, 1, 2] and len(out["chunks"]) == 3
    # the coordinator checked every message's number; each worker sent a message per token and one more
    assert out["received"] == {f"mr/w{d['index']}": len(d["tokens"]) + 1 for d in done}
    assert all(d["tokens"] and out["summaries"][d["index"]] for d in done)
    reference = direct.generate([d["prompt"] for d in done], max(len(d["tokens"]) for d in done), ignore_eos=True)
    assert [r[:len(d["tokens"])] for r, d in zip(reference, done)] == [d["tokens"] for d in done]
    assert isinstance(out["summary"], str)


def test_planner_executor_runs_the_plan_as_tool_calls_over_http(runtime, nodes, tool):
    _Tool.calls.clear()
    with on_both_nodes(runtime):
        messages, out = _sent(runtime.launch(AGENTS / "planner_executor",
                                             {"tool_url": tool, "steps": 2, "max_tokens": 8,
                                              "executor_node": nodes["b"]},
                                             name="planner", node=nodes["a"], limits=_limits(runtime)))
    assert len(out["plan"]) == 2 and all(isinstance(s, str) and 4 <= len(s) <= 20 for s in out["plan"])
    assert [m["seq"] for m in messages] == [0, 1] and [m["step"] for m in messages] == out["plan"]
    calls = out["executor"]["calls"]
    assert len(calls) == 2 and all(set(c) == {"city"} for c in calls)         # constrained: valid calls only
    assert [c["city"] for c in _Tool.calls] == [c["city"] for c in calls]     # each reached the tool once
    assert [r["result"] for r in out["results"]] == \
        [{"city": c["city"], "population": 1000 * len(c["city"])} for c in calls]
    assert out["executor"]["messages"] == 3                                   # two steps and the close


def test_react_keeps_its_working_set_across_slow_tool_calls(runtime, nodes, tool):
    _Tool.calls.clear()
    with on_both_nodes(runtime) as engines:
        computed = _computed(engines)
        processes = [runtime.launch(AGENTS / "react", {"tool_url": tool, "calls": 3, "delay_ms": 200,
                                                       "max_tokens": 6}, node=nodes[n], limits=_limits(runtime))
                     for n in ("a", "b")]
        runs = [_sent(p) for p in processes]
        computed = _computed(engines) - computed
    assert len(_Tool.calls) == 6 and all(c["delay_ms"] == "200" for c in _Tool.calls)
    for steps, out in runs:
        assert [s["seq"] for s in steps] == [0, 1, 2] and steps == out["steps"]
        fed, answers = out["fed"], out["answer_tokens"]
        # after each call only the answer turn and a constant few tokens around it were prefilled
        overheads = {f - a for f, a in zip(fed[1:], answers)}
        assert len(overheads) == 1 and 0 < overheads.pop() < 8, (fed, answers)
        assert out["folded"] > fed[0] + sum(fed[1:])
    # every row the agents' working sets hold was computed once (or taken from the prefix cache)
    assert computed == sum(out["folded"] - out["cached_tokens"] for _, out in runs)


def test_tree_of_thought_forks_scores_and_expands_the_best_branch(runtime, nodes, direct):
    with on_both_nodes(runtime):
        processes = [runtime.launch(AGENTS / "tree_of_thought", {"branching": 2, "depth": 3, "thought_tokens": 4},
                                    node=nodes[n]) for n in ("a", "b")]
        runs = [_sent(p) for p in processes]
    for levels, out in runs:
        assert levels == out["levels"] and [lv["seq"] for lv in levels] == [0, 1, 2] and out["forks"] == 6
        for lv in levels:
            scores = [b["score"] for b in lv["branches"]]
            assert len(scores) == 2 and scores[lv["best"]] == max(scores) and all(s <= 0 for s in scores)
            firsts = [b["tokens"][0] for b in lv["branches"]]
            assert len(set(firsts)) == 2 and all(len(b["tokens"]) == 4 for b in lv["branches"])
        assert out["path"] == [t for lv in levels for t in lv["branches"][lv["best"]]["tokens"]]
    # the first level's top branch is the greedy continuation of the question
    [greedy] = direct.generate([runs[0][1]["prompt"]], 4, ignore_eos=True)
    assert runs[0][1]["levels"][0]["branches"][0]["tokens"] == greedy
    assert runs[0][1] == runs[1][1]              # the same program on either node's engine, the same tree
