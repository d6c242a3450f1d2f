"""Soak: `pie serve` under a mixed load for minutes, checking every answer and watching memory.

    python bench/soak.py [--minutes 10] [--clients 48] [--think-s 1.0] [--cancel 0.1] [--numbers 8]
                         [--dtype float32] [--compile off] [--threads 1] [--out bench/RESULTS.md]

The server runs in a process of its own (its RSS is sampled every few seconds). `--clients` clients
each wait an exponential think time (Poisson arrivals) and then send one request of a random kind
about a random number n < `--numbers`; every prompt asks for n written out in words:

  chat      streamed chat completion, greedy; a `--cancel` share is closed after 1-4 chunks
  fork      `n=2` with temperature 0.7 and seed n: one prompt, two sampled choices
  json      `response_format` json_schema {number, words}, greedy
  tools     a tool call (`tool_choice="required"`, the arguments hold n) then the answer to the
            tool's result, greedy
  session   a WebSocket session (examples/interactive_chat through `pie_actors.client.Client`): two
            turns in one working set, greedy; a `--cancel` share is killed after its first turn

Each (kind, n) has a reference: the same request sent alone before the load starts. Every answer is
compared with its own reference, whole: equal is "exact"; equal to another number's reference of
that kind is "another's output"; otherwise "changed" (lost, duplicated or other tokens). The sampled
kind (fork) is reported apart: a sample may differ from its reference by a near-tie under batched
float rounding, and that is not lost output. At the end, once idle: no inferlet left, every KV page
not referenced, the page counts adding up to the pool. Per minute: requests, errors, TTFT and TPOT
p50/p99 (streamed chats), the server's RSS; its slope in MiB/min over the run's second half.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import random
import signal
import socket
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from report import add_output_options, publish

MODEL = "smollm2-135m-instruct"
KEY = "soak-key"
KINDS = ("chat", "fork", "json", "tools", "session")
OTHERS = "another's output"
CHAT = Path(__file__).resolve().parent.parent / "examples" / "interactive_chat" / "main.py"
NUMBER = {"type": "object", "additionalProperties": False, "required": ["number", "words"],
          "properties": {"number": {"type": "integer"}, "words": {"type": "string", "maxLength": 40}}}
SPELL = {"type": "function", "function": {
    "name": "spell_number", "description": "Write a number out in words.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["number"],
                   "properties": {"number": {"type": "integer"}}}}}
WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()


def ask(n: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Write the number {n} in words."}]


# ---- the server, in a process of its own -----------------------------------------------------------

def _serve(port: int, settings: dict[str, Any], ready: Any) -> None:
    from pie_actors.serve import Server
    server = Server(MODEL, port=port, api_keys=(KEY,), **settings)
    server.start().wait_ready()
    ready.put(server.url)
    signal.sigwait({signal.SIGTERM})
    server.close()


def start_server(settings: dict[str, Any]) -> tuple[multiprocessing.Process, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    process = ctx.Process(target=_serve, args=(port, settings, ready), daemon=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})     # the child inherits it blocked: sigwait
    process.start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    while process.is_alive():
        try:
            return process, ready.get(timeout=1)
        except queue.Empty:
            pass
    raise SystemExit(f"the server process ended before it was ready (exit code {process.exitcode})")


def engine_state(url: str) -> dict[str, Any]:
    """Running inferlets and KV pages by state, from the server's /metrics."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(request, timeout=30).read().decode()
    state: dict[str, Any] = {"kv": {}}
    for line in text.splitlines():
        if line.startswith("pie_running_inferlets "):
            state["running"] = int(float(line.split()[1]))
        elif line.startswith("pie_kv_pages{"):
            name = line.split('"')[1]
            state["kv"][name] = int(float(line.split()[1]))
    return state


# ---- the requests ------------------------------------------------------------------------------

@dataclass
class Outcome:
    kind: str
    n: int
    answer: Any = None              # None: cancelled
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None


class Load:
    def __init__(self, url: str, cancel: float, rng: random.Random) -> None:
        import httpx
        import openai
        self.url, self.cancel, self.rng = url, cancel, rng
        self.openai = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600,
                                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=256)))

    async def run(self, kind: str, n: int, may_cancel: bool) -> Outcome:
        outcome = Outcome(kind, n)
        try:
            await getattr(self, kind)(outcome, may_cancel and self.rng.random() < self.cancel)
        except Exception as e:
            outcome.error = type(e).__name__
        return outcome

    def _chat(self, number: int, **kw: Any):
        return self.openai.chat.completions.create(model="default", messages=ask(number), **{"temperature": 0, **kw})

    async def chat(self, out: Outcome, cancel: bool) -> None:
        t0, first, last, chunks, text = time.perf_counter(), None, None, 0, ""
        stream = await self._chat(out.n, max_tokens=16, stream=True)
        stop_after = self.rng.randint(1, 4)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first, chunks = first or last, chunks + 1
                text += chunk.choices[0].delta.content
                if cancel and chunks >= stop_after:
                    await stream.close()
                    return
        out.answer = text
        if first is not None:
            out.ttft, out.tpot = first - t0, (last - first) / max(chunks - 1, 1)

    async def fork(self, out: Outcome, cancel: bool) -> None:
        reply = await self._chat(out.n, max_tokens=12, n=2, temperature=0.7, seed=out.n)
        out.answer = [c.message.content for c in reply.choices]

    async def json(self, out: Outcome, cancel: bool) -> None:
        reply = await self._chat(out.n, max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "number", "schema": NUMBER}})
        out.answer = reply.choices[0].message.content

    async def tools(self, out: Outcome, cancel: bool) -> None:
        call = (await self._chat(out.n, max_tokens=40, tools=[SPELL], tool_choice="required")).choices[0].message
        arguments = call.tool_calls[0].function.arguments
        number = json.loads(arguments).get("number")
        spelled = WORDS[number] if isinstance(number, int) and 0 <= number < len(WORDS) else "unknown"
        messages = ask(out.n) + [
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                  "function": {"name": "spell_number", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": spelled}]
        final = await self.openai.chat.completions.create(model="default", messages=messages, temperature=0,
                                                          max_tokens=16)
        out.answer = [arguments, final.choices[0].message.content]

    async def session(self, out: Outcome, cancel: bool) -> None:
        out.answer = await asyncio.to_thread(self._session, out.n, cancel)

    def _session(self, n: int, cancel: bool) -> list[str] | None:
        from pie_actors import Send
        from pie_actors.client import Client
        with Client(self.url, KEY, timeout=600) as client:
            process = client.submit(CHAT, {"max_tokens": 12, "turns": 2})
            events = process.events(timeout=600)
            replies = []
            for i, text in enumerate((ask(n)[0]["content"], f"And the number {n + 1}?")):
                process.send(text)
                event = next(events)
                if not isinstance(event, Send):
                    raise RuntimeError(f"the session ended early: {event}")
                replies.append(json.loads(event.text)["reply"])
                if cancel and i == 0:
                    process.kill()
                    return None
            process.result(timeout=600)
            return replies


def classify(outcome: Outcome, references: dict[tuple[str, int], Any]) -> str:
    if outcome.error is not None:
        return "error"
    if outcome.answer is None:
        return "cancelled"
    if outcome.answer == references[outcome.kind, outcome.n]:
        return "exact"
    if any(outcome.answer == ref for (kind, n), ref in references.items() if kind == outcome.kind and n != outcome.n):
        return "another's output"
    return "sampled differs" if outcome.kind == "fork" else "changed"


# ---- the run -------------------------------------------------------------------------------------

@dataclass
class Minute:
    outcomes: list[tuple[Outcome, str]] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)    # (minutes into the run, MiB)


def percentiles(values: list[float], scale: float = 1e3) -> str:
    if not values:
        return "–"
    p50, p99 = np.percentile(values, [50, 99])
    return f"{p50 * scale:.0f} / {p99 * scale:.0f}"


async def soak(url: str, server_pid: int, args: argparse.Namespace) -> tuple[dict, dict[int, Minute], float]:
    import psutil
    rng = random.Random(args.seed)
    load = Load(url, args.cancel, rng)
    references = {}
    for kind in KINDS:                   # each request alone: the references, and the warm-up
        for n in range(args.numbers):
            outcome = await load.run(kind, n, may_cancel=False)
            if outcome.error is not None:
                raise SystemExit(f"the reference {kind} {n} failed: {outcome.error}")
            references[kind, n] = outcome.answer
    print(f"{len(references)} references taken", file=sys.stderr, flush=True)
    minutes: dict[int, Minute] = defaultdict(Minute)
    server = psutil.Process(server_pid)
    start = time.monotonic()
    end = start + args.minutes * 60

    def minute() -> int:
        return int((time.monotonic() - start) // 60)

    async def client() -> None:
        while True:
            await asyncio.sleep(rng.expovariate(1 / args.think_s))
            if time.monotonic() >= end:
                return
            at = minute()
            outcome = await load.run(rng.choice(KINDS), rng.randrange(args.numbers), may_cancel=True)
            minutes[at].outcomes.append((outcome, classify(outcome, references)))

    async def sample_rss() -> None:
        while time.monotonic() < end:
            minutes[minute()].rss.append(((time.monotonic() - start) / 60, server.memory_info().rss / 2**20))
            await asyncio.sleep(5)

    await asyncio.gather(sample_rss(), *(client() for _ in range(args.clients)))
    await load.openai.close()
    wall = time.monotonic() - start
    return references, minutes, wall


def report(minutes: dict[int, Minute], idle: dict[str, Any], start_kv: dict[str, int], wall: float,
           args: argparse.Namespace) -> str:
    rows = ["| minute | requests | exact | cancelled | errors | chat TTFT p50/p99 ms | chat TPOT p50/p99 ms | "
            "server RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    totals: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    errors: Counter[str] = Counter()
    rss_points: list[tuple[float, float]] = []
    for m in sorted(minutes):
        got = minutes[m]
        counts = Counter(c for _, c in got.outcomes)
        totals.update(counts)
        for outcome, c in got.outcomes:
            by_kind[outcome.kind][c] += 1
            if outcome.error:
                errors[f"{outcome.kind}: {outcome.error}"] += 1
        chats = [o for o, c in got.outcomes if o.kind == "chat" and o.ttft is not None]
        rss = f"{np.mean([r for _, r in got.rss]):.0f}" if got.rss else "–"
        rss_points += got.rss
        rows.append(f"| {m + 1} | {len(got.outcomes)} | {counts['exact']} | {counts['cancelled']} | "
                    f"{counts['error']} | {percentiles([o.ttft for o in chats])} | "
                    f"{percentiles([o.tpot for o in chats])} | {rss} |")
    half = [(t, r) for t, r in rss_points if t >= args.minutes / 2]
    slope = np.polyfit(*zip(*half), 1)[0] if len(half) >= 2 else float("nan")
    kinds = ["| kind | " + " | ".join(("exact", "changed", "another's output", "sampled differs", "cancelled",
                                        "error")) + " |", "|---" * 7 + "|"]
    for kind in KINDS:
        c = by_kind[kind]
        kinds.append(f"| {kind} | " + " | ".join(str(c[k]) for k in ("exact", "changed", "another's output",
                                                                       "sampled differs", "cancelled", "error")) + " |")
    kv = idle["kv"]
    checks = [
        f"- requests: {sum(totals.values())} in {wall / 60:.1f} min ({sum(totals.values()) / wall:.2f}/s); "
        f"changed (lost, duplicated or other tokens, greedy kinds): **{totals['changed']}**; "
        f"another's output: **{totals[OTHERS]}**; sampled fork replies that differ from their "
        f"reference: {totals['sampled differs']}",
        f"- errors by kind: {dict(errors) or 'none'}",
        f"- at idle: {idle.get('running', '?')} inferlets running; KV pages {kv} (before the load: {start_kv}); "
        f"referenced pages back to their start: **{kv.get('referenced') == start_kv.get('referenced')}**, "
        f"free + referenced + cached == total: **{kv.get('free', 0) + kv.get('referenced', 0) + kv.get('cached', 0) == kv.get('total')}**",
        f"- server RSS slope over the second half: **{slope:+.1f} MiB/min**",
    ]
    return "\n".join(rows) + "\n\n" + "\n".join(kinds) + "\n\n" + "\n".join(checks) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--think-s", type=float, default=1.0, help="mean think time between a client's requests")
    ap.add_argument("--cancel", type=float, default=0.1, help="share of streamed chats and sessions cancelled")
    ap.add_argument("--numbers", type=int, default=8, help="distinct numbers (references: 5 kinds each)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", default="off", choices=("auto", "on", "off"))
    ap.add_argument("--threads", type=int, default=1, help="the engine's CPU threads (bench/serve.py: busy cores)")
    ap.add_argument("--seed", type=int, default=20261201)
    add_output_options(ap, "Soak: pie serve under a mixed load")
    args = ap.parse_args()
    settings = dict(dtype=args.dtype, compile=args.compile, num_threads=args.threads, timeout_s=600)
    process, url = start_server(settings)
    try:
        start_kv = engine_state(url)["kv"]
        references, minutes, wall = asyncio.run(soak(url, process.pid, args))
        deadline = time.monotonic() + 120
        while (idle := engine_state(url)).get("running") and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        os.kill(process.pid, signal.SIGTERM)
        process.join(60)
    env = (f"SmolLM2-135M-Instruct, {args.dtype}, compile {args.compile}, {args.threads} engine thread(s); "
           f"{args.clients} clients, think time Exp(mean {args.think_s} s), {args.cancel:.0%} of chats and "
           f"sessions cancelled; {args.numbers} numbers x {len(KINDS)} kinds of request, each with a reference "
           f"taken alone; {args.minutes:g} min")
    publish(env, report(minutes, idle, start_kv, wall, args), args.out, args.title)


if __name__ == "__main__":
    main()
