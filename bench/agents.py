"""Agent workflows three ways on one engine: as inferlets, and driven by a client over pie serve's
OpenAI API with the prefix cache on and off; and messages between agents on two Ray nodes.

    python bench/agents.py [--quick] [--jobs 4] [--tokens 4] [--out bench/RESULTS.md]

Arms (one `pie_actors.serve.Server`, eager engine, float32; every arm on its engine):
  inferlets  each job is one program launched on the server's runtime (the launch API): it keeps its
             working sets across steps and forks them (`ws.fork`), so a step computes only its new tokens
  client     the same workflow from a client, one OpenAI request a step (httpx, greedy, `ignore_eos`):
             each request carries the whole conversation; the prefix cache finds its full pages
  no-cache   the client path with `[engine] prefix_cache` off (switched on the same engine): every
             request computes its whole prompt

Workflows (every reply `--tokens` tokens, greedy, except tree of thought's sampled client branches):
  react-K-Lms  ReAct: K tool calls to an HTTP tool that answers after L ms (the inferlet calls it with
               http.fetch, the client with httpx), each result fed as an observation turn, then an answer;
               K in 2, 8, 16 and L in 0, 50, 200 (--quick: K 2, 8 and L 0, 50)
  tot          tree of thought, branching 2, depth 3 (examples/agents/tree_of_thought; the client asks
               /v1/completions for n=2 sampled branches with logprobs a level and extends the best)
  judge        one article, six questions on it (six forks of its working set; the client: six requests
               that repeat the article), then a merge of the six verdicts
  debate       examples/agents/debate (three agents, three rounds, a judge) on a two-node Ray cluster
               (ray.cluster_utils), an engine replica on each node: inferlets only
  messages     one-way message latency between two inferlets on the two nodes (half the round trip of
               a send_to / receive_from ping-pong, timed inside the sandbox; the dummy model)

Per workflow and arm: `--jobs` jobs started at once; job completion time p50/p99, programs/s (jobs over
the wall time), and the engine's rows computed per job (tokens_computed: prefill and decode) beside the
rows the no-cache arm computed for the same work (reused = no-cache's minus this arm's).

Targets: tot and judge inferlets >= 2x the client arm's programs/s; react-8 inferlets >= 1.2x the client
arm's (at each latency); message latency p50 <= 2 ms between nodes.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, urlparse

from report import add_output_options, publish

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ROOT / "examples" / "agents"
SYSTEM = "You are a helpful assistant."
QUESTION = "Which is larger, Paris or Rome? Look it up step by step."
TOT_QUESTION = "How could a small town cut its traffic? Think step by step."
ARTICLE = ("The river town grew around a wooden bridge. Traders crossed it every market day. A flood in "
           "1820 carried the bridge away, and the town built a stone bridge with three arches the next "
           "year. Railways came in 1870, factories rose along the bank, and today the old mills are flats "
           "and a museum. ") * 3
JUDGE_QUESTIONS = ["Is it accurate?", "Is it clear?", "Is it complete?", "Is it concise?", "Is it neutral?",
                   "Is it well ordered?"]

REACT = """
from inferlet import chat, http
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def main(input):
    ws, pipe, rows = WorkingSet(), Pipeline(), 0
    feed = chat.system(input["system"]) + chat.user(input["question"]) + chat.cue_without_thinking()
    for step in range(input["calls"] + 1):
        for _ in range(input["tokens"]):
            fwd = ForwardPass()
            fwd.embed(feed)
            fwd.state([ws], StateGeometry.folding())
            token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
            pipe.submit(fwd)
            rows += len(feed)
            feed = [await token]
        if step == input["calls"]:
            break
        r = await http.fetch(f"{input['tool']}/tool?step={step}&delay_ms={input['delay_ms']}")
        feed = feed + chat.seal() + chat.user("Observation: " + r.text) + chat.cue_without_thinking()
    pipe.close()
    return {"rows": rows}
"""

JUDGE = """
import asyncio
from inferlet import chat, model
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

async def reply(ws, feed, n):
    pipe, out = Pipeline(), []
    for _ in range(n):
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        token = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        feed = [await token]
        out.append(feed[0])
    pipe.close()
    return model.decode(out)

async def main(input):
    base, pipe = WorkingSet(), Pipeline()
    fwd = ForwardPass()
    fwd.embed(chat.system(input["system"]) + chat.user(input["article"]))
    fwd.state([base], StateGeometry.folding())
    pipe.submit(fwd)
    forks = [base.fork(pipe) for _ in input["questions"]]
    verdicts = await asyncio.gather(*(reply(ws, chat.user(q) + chat.cue_without_thinking(), input["tokens"])
                                      for ws, q in zip(forks, input["questions"])))
    merged = "; ".join(verdicts)
    return await reply(base.fork(pipe), chat.user("Verdicts: " + merged + " Merge them.")
                       + chat.cue_without_thinking(), input["tokens"])
"""

PING = """
import time
from inferlet import runtime, session

PONG = "from inferlet import session\\nasync def main(input):\\n    for _ in range(input['n']):\\n" \\
       "        sender, message = await session.receive_from()\\n        session.send_to(sender, message)\\n"

async def main(input):
    peer = await runtime.spawn(PONG, {"n": input["n"]}, node=input["node"])
    rtts = []
    for i in range(input["n"]):
        start = time.perf_counter()
        session.send_to(peer.name, i)
        sender, message = await session.receive_from()
        if message != i:
            raise ValueError(f"ping {i} came back as {message!r}")
        rtts.append(time.perf_counter() - start)
    await peer.result()
    return rtts
"""


class _Tool(BaseHTTPRequestHandler):
    """GET /tool?step=N&delay_ms=L: {"step": N, "value": ...} after L ms."""

    def do_GET(self):
        query = {k: v[0] for k, v in parse_qs(urlparse(self.path).query).items()}
        time.sleep(int(query.get("delay_ms", 0)) / 1000)
        body = json.dumps({"step": int(query["step"]), "value": 1000 + 7 * int(query["step"])}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@dataclasses.dataclass
class Result:
    workflow: str
    arm: str
    times: list[float]           # each job's completion time, s
    wall: float                  # all jobs, started at once
    computed: int                # engine rows computed by the jobs

    def p(self, q: float) -> float:
        ordered = sorted(self.times)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def rate(self) -> float:
        return len(self.times) / self.wall


class Client:
    """One workflow step a request, over the OpenAI API of the server at `url`."""

    def __init__(self, url: str, model: str, tool: str, tokens: int) -> None:
        import httpx

        self.http, self.url, self.model = httpx.Client(timeout=600), url, model
        self.tool, self.tokens = tool, tokens

    def chat(self, messages: list[dict]) -> str:
        r = self.http.post(f"{self.url}/v1/chat/completions", json={
            "model": self.model, "messages": messages, "max_tokens": self.tokens, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    def react(self, n: int, calls: int, delay_ms: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": case(n, QUESTION)}]
        for step in range(calls + 1):
            text = self.chat(messages)
            if step == calls:
                return
            observation = self.http.get(f"{self.tool}/tool?step={step}&delay_ms={delay_ms}").text
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Observation: " + observation}]

    def tot(self, n: int, branching: int = 2, depth: int = 3) -> None:
        path, question = "", case(n, TOT_QUESTION)
        for level in range(depth):
            r = self.http.post(f"{self.url}/v1/completions", json={
                "model": self.model, "prompt": f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{path}",
                "max_tokens": self.tokens, "n": branching, "temperature": 1.0, "seed": level, "logprobs": 1,
                "ignore_eos": True})
            r.raise_for_status()
            choices = r.json()["choices"]
            best = max(choices, key=lambda c: statistics.mean(c["logprobs"]["token_logprobs"]))
            path += best["text"]

    def judge(self, n: int) -> None:
        base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": case(n, ARTICLE)}]
        with ThreadPoolExecutor(len(JUDGE_QUESTIONS)) as pool:
            verdicts = list(pool.map(lambda q: self.chat(base + [{"role": "user", "content": q}]), JUDGE_QUESTIONS))
        self.chat(base + [{"role": "user", "content": "Verdicts: " + "; ".join(verdicts) + " Merge them."}])


def case(n: int, text: str) -> str:
    """`text` as job `n`'s: jobs differ from their first tokens on, so no job finds another's pages."""
    return f"Case {n}. {text}"


def measure(jobs: int, job: Callable[[int], Any], engine: Any, numbers: Iterator[int]) -> tuple[list[float], float, int]:
    """(each job's time, the wall time, engine rows computed) of `jobs` jobs started at once, each
    given a number of its own."""
    computed, start = engine.tokens_computed, time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        times = list(pool.map(lambda n: _timed(lambda: job(n)), [next(numbers) for _ in range(jobs)]))
    return times, time.perf_counter() - start, engine.tokens_computed - computed


def single_node(args: argparse.Namespace, tool: str) -> list[Result]:
    from pie_actors.serve import Server
    from pie_actors.serve.server import served_names

    react = [(k, ms) for k in ((2, 8) if args.quick else (2, 8, 16)) for ms in ((0, 50) if args.quick else (0, 50, 200))]
    results = []
    with Server(None, port=0, dtype="float32", compile="off", num_pages=4096, num_threads=args.threads) as server:
        runtime, engine = server.runtime, server.runtime.engine
        limits = dataclasses.replace(runtime.config.limits, allow_hosts=("127.0.0.1",), timeout_s=1800)
        client = Client(server.url, served_names(server.config)[0], tool, args.tokens)

        def launch(program: Any, input: Callable[[int], dict]) -> Callable[[int], Any]:
            return lambda n: runtime.launch(program, input(n), limits=limits).result()

        workflows: list[tuple[str, Callable[[int], Any], Callable[[int], Any]]] = [
            (f"react-{k}-{ms}ms", launch(REACT, lambda n, k=k, ms=ms: {
                "system": SYSTEM, "question": case(n, QUESTION), "calls": k, "delay_ms": ms, "tokens": args.tokens,
                "tool": tool}), lambda n, k=k, ms=ms: client.react(n, k, ms)) for k, ms in react]
        workflows += [("tot", launch(AGENTS / "tree_of_thought", lambda n: {
                          "question": case(n, TOT_QUESTION), "branching": 2, "depth": 3, "thought_tokens": args.tokens}),
                       client.tot),
                      ("judge", launch(JUDGE, lambda n: {"system": SYSTEM, "article": case(n, ARTICLE),
                                                         "questions": JUDGE_QUESTIONS, "tokens": args.tokens}),
                       client.judge)]
        numbers = itertools.count()
        for name, inferlet, by_client in workflows:
            inferlet(next(numbers)), by_client(next(numbers))      # warm-up: the program's build, the connections
            for arm, job in (("inferlets", inferlet), ("client", by_client), ("no-cache", by_client)):
                engine.kv.prefix_cache = arm != "no-cache"
                results.append(Result(name, arm, *measure(args.jobs, job, engine, numbers)))
                print(row(results[-1], results), flush=True)
            engine.kv.prefix_cache = True
    return results


def two_nodes(args: argparse.Namespace) -> tuple[list[float], Result]:
    """(one-way message latencies between the nodes, the debate's result)."""
    import ray
    from ray.cluster_utils import Cluster

    from pie_actors import Runtime
    from pie_actors.controller import NAMESPACE

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        ids = {key[-1]: n["NodeID"] for n in ray.nodes() for key in n["Resources"] if key in ("node_a", "node_b")}
        with Runtime.connect(model="dummy", device="cpu", dtype="float32", compile="off", num_pages=64,
                             num_threads=1, replicas=2) as runtime:
            runtime.launch(PING, {"n": 20, "node": ids["b"]}, node=ids["a"]).result(600)   # warm-up
            rtts = runtime.launch(PING, {"n": args.pings, "node": ids["b"]}, node=ids["a"]).result(600)
        with Runtime.connect(device="cpu", dtype="float32", compile="off", num_pages=512, num_threads=1,
                             replicas=2, timeout_s=1800) as runtime:
            debate = lambda: runtime.launch(AGENTS / "debate", {"rounds": 3, "max_tokens": args.tokens}).result()
            debate()
            computed = lambda: sum(ray.get(e.stats.remote())["tokens_computed"] for e in _engines(ray))
            before, start = computed(), time.perf_counter()
            with ThreadPoolExecutor(2) as pool:
                times = list(pool.map(lambda _: _timed(debate), range(2)))
            result = Result("debate (2 nodes)", "inferlets", times, time.perf_counter() - start, computed() - before)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return [r / 2 for r in rtts], result


def _engines(ray: Any) -> list:
    from pie_actors.replicas import ENGINE_PREFIX

    return [ray.get_actor(n) for n in ray.util.list_named_actors() if n.startswith(ENGINE_PREFIX)
            and not n.endswith(":dummy")]


def _timed(job: Callable[[], Any]) -> float:
    start = time.perf_counter()
    job()
    return time.perf_counter() - start


def row(r: Result, results: list[Result]) -> str:
    nocache = next((x for x in results if x.workflow == r.workflow and x.arm == "no-cache"), None)
    reused = f"{(nocache.computed - r.computed) / len(r.times):.0f}" if nocache else "-"
    return (f"| {r.workflow} | {r.arm} | {len(r.times)} | {r.p(0.5):.2f} | {r.p(0.99):.2f} | {r.rate:.2f} | "
            f"{r.computed / len(r.times):.0f} | {reused} |")


def tables(results: list[Result], latency: list[float]) -> str:
    head = ("| workflow | arm | jobs | JCT p50 s | JCT p99 s | programs/s | rows computed/job | reused/job vs no-cache |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = [row(r, results) for r in results]
    rate = {(r.workflow, r.arm): r.rate for r in results}
    targets = ["| target | figure | met |", "|---|---|---|"]
    for name in sorted({r.workflow for r in results if (r.workflow, "client") in rate}):
        need = 2.0 if name in ("tot", "judge") else 1.2 if name.startswith("react-8-") else None
        if need is not None:
            x = rate[name, "inferlets"] / rate[name, "client"]
            targets.append(f"| {name}: inferlets / client programs/s >= {need} | {x:.2f}x | {'yes' if x >= need else 'no'} |")
    ms = sorted(x * 1000 for x in latency)
    p50 = ms[len(ms) // 2]
    targets.append(f"| message latency p50 between nodes <= 2 ms | {p50:.2f} ms (p99 {ms[int(0.99 * len(ms))]:.2f} ms, "
                   f"{len(ms)} messages) | {'yes' if p50 <= 2 else 'no'} |")
    return head + "\n".join(lines) + "\n\n" + "\n".join(targets) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="ReAct at 2 and 8 calls, 0 and 50 ms only")
    ap.add_argument("--jobs", type=int, default=4, help="jobs of a workflow started at once, per arm")
    ap.add_argument("--tokens", type=int, default=4, help="tokens of every reply")
    ap.add_argument("--pings", type=int, default=200, help="messages the latency is taken over")
    ap.add_argument("--threads", type=int, default=1, help="the engine's threads")
    add_output_options(ap, "Agent workflows: inferlets against a client over the OpenAI API")
    args = ap.parse_args()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Tool)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    load = os.getloadavg()[0]
    results = single_node(args, f"http://127.0.0.1:{httpd.server_address[1]}")
    latency, debate = two_nodes(args)
    results.append(debate)
    print(row(debate, results), flush=True)
    httpd.shutdown()
    env = (f"SmolLM2-135M-Instruct, float32, eager engine, {args.threads} thread(s); {args.jobs} jobs a workflow and "
           f"arm at once; {args.tokens} tokens a reply; debate: 3 rounds on two Ray nodes of this machine, an engine "
           f"on each, 2 at once; 1-min load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, tables(results, latency), args.out, args.title)


if __name__ == "__main__":
    sys.exit(main())
