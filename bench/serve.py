"""pie serve under load: streaming OpenAI clients against `pie serve`, llama-cpp-python's server on the
same weights, and the engine's own batched decode, in one run.

    python bench/serve.py [--concurrency 1,4,16,32] [--tokens 64] [--systems serve,llamacpp,engine]
                          [--dtype bfloat16] [--compile auto] [--threads N] [--pin-cores on] [--cluster]
                          [--quick]
                          [--out bench/RESULTS.md]

At each concurrency C, C clients (the async `openai` client, chat.completions with stream=True, in a
process of their own) send requests back to back, each a short chat of its own, until 2C requests (at
least 8) have been answered; then the same for the next system. Per system and C: TTFT p50/p99 (from
sending a request to its first text), TPOT p50 (per request: from its first text to its last, over the
tokens after the first), output tokens/s (every request's completion tokens over the wall time of the
level) and requests/s; each row ends with the machine's 1-min load average. Other jobs on the cores
slow every system, and threads that wait on each other at every op most of all: at a load of 4 on 2
cores the eager engine decoded a token in 1.4 s with 2 threads and in 47 ms with 1, so on a busy
machine `--threads 1` measures the systems rather than the scheduler. The systems of one C are
measured one after the other, so a ratio in one run compares figures taken minutes apart at most.

  serve     `pie serve` (`pie_actors.serve.Server`; compile "auto", its default, is compiled decode on
            CPUs with AVX2 or better: a first start on a machine compiles a graph per batch bucket up
            to the largest C, minutes each on 2 cores, and later starts compile again (RESULTS.md,
            "Compiled engine start");
            `--compile off` starts in seconds, on the eager engine). It runs in this process with its
            engine in a child process, as `pie serve --local` does; with `--one-process`, the engine
            in this process too; with `--cluster`, on a Ray cluster of its own, as `pie serve` does
            by default: the engine in its actor, each request a process on an inferlet host actor
  llamacpp  llama-cpp-python's server (`python -m llama_cpp.server`) on an F16 GGUF of the same
            weights (gguf_variants.py), as many threads as the engine. It runs one request at a
            time; it starts with `--interrupt_requests False` so that a new request waits instead of
            cutting the running one
  engine    `engine.generate` of the same prompts on an engine of the served one's settings in this
            process (with `--one-process`, on the served engine), C at a time, greedy: the batched decode with no HTTP,
            no sandbox and no program in between

Equal work: greedy, every reply exactly `--tokens` tokens (`ignore_eos` for pie serve, `min_tokens`
for llama.cpp, whose repeat penalty, on by default in its API, is turned off), prompts rendered by the
model's own chat template on both servers. The table's "tokens/request" column is each system's own
count (pie serve: the stream's usage; llama.cpp's stream has no usage, so its content chunks, one a
token) and the run stops if a system's differs from `--tokens`; the line above the tables gives one
unstreamed reply's usage (prompt + completion tokens) from each server.

Weights: bfloat16 for the engine and F16 for llama.cpp. Decode on a CPU is bound by reading the
weights, and both formats are 2 bytes a weight, so both read the same bytes a token, each in its own
native 16-bit path (llama.cpp has no bf16 matmul worth comparing; the engine's "auto" dtype is bf16 on
CPUs with bf16 instructions). float32 against F16 would make the engine read twice the bytes.

Targets (the second table): at C=1, pie serve's TPOT within 1.1x of engine.generate's; at C=16,
output tokens/s at least 3x llama-cpp-python's server; at C=32, at least 0.85x engine.generate's.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gguf_variants import OUT_DIR, variant
from report import add_output_options, publish

SYSTEMS = ("serve", "llamacpp", "engine")
MODEL = "smollm2-135m-instruct"
LLAMA_CPP_START_S = 120.0
SERVE_START_S = 3600.0     # a first compiled start compiles six decode buckets: 20 min on 2 busy cores


def messages(i: int) -> list[dict[str, str]]:
    """Request i's chat: short, and its own (no two share more than the chat template's opening)."""
    return [{"role": "user", "content": f"Story {i}: tell me about an old fisherman and the sea."}]


@dataclass(frozen=True)
class Stream:
    """One request as its client saw it."""
    ttft: float      # seconds from sending it to its first text
    tpot: float      # seconds a token after the first
    tokens: int      # completion tokens, as the system counts them


@dataclass(frozen=True)
class EngineShare:
    """What the engine did during a load: its decode steps' mean lanes, and the ms an executed step
    spent in the model, in the epilogues and in its own bookkeeping (plan + finish)."""
    lanes: float
    model_ms: float
    epilogue_ms: float
    own_ms: float


@dataclass(frozen=True)
class Load:
    streams: list[Stream]
    wall: float                         # seconds from the first request sent to the last answered
    engine: EngineShare | None = None   # the engine meanwhile (None for llama.cpp)


# ---- the load generator (its own process) ----------------------------------------------------------

async def _stream(client: Any, model: str, i: int, max_tokens: int, extra: dict[str, Any]) -> Stream:
    t0 = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    response = await client.chat.completions.create(
        model=model, messages=messages(i), max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in response:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            chunks += 1
    if first is None:
        raise RuntimeError(f"request {i} streamed no text")
    tokens = usage if usage is not None else chunks
    return Stream(first - t0, (last - first) / max(tokens - 1, 1), tokens)


async def _closed_loop(url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                       extra: dict[str, Any], first_index: int) -> Load:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)))
    todo = iter(range(first_index, first_index + requests))
    streams: list[Stream] = []

    async def client_loop() -> None:
        for i in todo:                 # the clients share one iterator: each takes the next request
            streams.append(await _stream(client, model, i, max_tokens, extra))

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return Load(streams, wall)


def drive(url: str, model: str, concurrency: int, requests: int, max_tokens: int, extra: dict[str, Any],
          first_index: int) -> Load:
    """`requests` streamed chat completions, `concurrency` at a time, against the server at `url`."""
    return asyncio.run(_closed_loop(url, model, concurrency, requests, max_tokens, extra, first_index))


# ---- the systems -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_cpp_server(gguf: Path, threads: int) -> Iterator[str]:
    """llama-cpp-python's server on `gguf` in a child process, queueing requests; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    log = open(OUT_DIR / "llama_cpp_server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
         "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
         "--n_ctx", "2048", "--interrupt_requests", "False", "--verbose", "False"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + LLAMA_CPP_START_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited ({process.returncode}); see {log.name}")
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llama_cpp.server did not answer in {LLAMA_CPP_START_S:.0f} s")
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def engine_stats(engine: Any) -> dict[str, Any]:
    """The figures of an Engine in this process that `engine_snapshot` reads, as a runtime's
    `stats()` gives them."""
    return {"decode_batch_sizes": engine.decode_batch_sizes, "step_seconds": engine.step_seconds}


def engine_snapshot(stats: dict[str, Any]) -> tuple[Counter, Counter]:
    """The decode batch sizes and step seconds so far, from `stats` (`engine_stats`, or a runtime's
    `stats()`, wherever its engine runs)."""
    return (Counter({int(k): v for k, v in stats["decode_batch_sizes"].items()}),
            Counter(stats["step_seconds"]))


def engine_share(stats: dict[str, Any], before: tuple[Counter, Counter]) -> EngineShare:
    """The engine's share of the load since `before` (an engine_snapshot)."""
    batches, seconds = engine_snapshot(stats)
    batches.subtract(before[0])
    seconds.subtract(before[1])
    per_step = {k: 1e3 * v / max(seconds["steps"], 1) for k, v in seconds.items()}
    return EngineShare(sum(k * v for k, v in batches.items()) / max(sum(batches.values()), 1),
                       per_step["model"], per_step["epilogue"], per_step["plan"] + per_step["finish"])


def engine_load(engine: Any, concurrency: int, requests: int, max_tokens: int, first_index: int) -> Load:
    """`engine.generate` of the same chats, `concurrency` prompts a call, until `requests` are done;
    each prompt's times taken as its tokens arrive."""
    tok = engine.tokenizer
    chats = [tok.encode(tok.chat_template.render(messages(i), add_generation_prompt=True))
             for i in range(first_index, first_index + requests)]
    streams: list[Stream] = []
    before = engine_snapshot(engine_stats(engine))
    t0 = time.perf_counter()
    for start in range(0, requests, concurrency):
        prompts = chats[start:start + concurrency]
        sent = time.perf_counter()
        times: list[list[float]] = [[] for _ in prompts]
        engine.generate(prompts, max_tokens, ignore_eos=True,
                        on_token=lambda lane, _token: times[lane].append(time.perf_counter()))
        streams += [Stream(t[0] - sent, (t[-1] - t[0]) / max(len(t) - 1, 1), len(t)) for t in times]
    wall = time.perf_counter() - t0
    return Load(streams, wall, engine_share(engine_stats(engine), before))


# ---- figures ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Figures:
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tokens_per_s: float
    requests_per_s: float
    tokens: tuple[int, ...]            # the distinct completion-token counts of the requests

    @classmethod
    def of(cls, load: Load) -> Figures:
        ttft = [s.ttft for s in load.streams]
        return cls(float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99)),
                   float(np.median([s.tpot for s in load.streams])),
                   sum(s.tokens for s in load.streams) / load.wall, len(load.streams) / load.wall,
                   tuple(sorted({s.tokens for s in load.streams})))


@dataclass(frozen=True)
class Row:
    system: str
    concurrency: int
    requests: int
    figures: Figures | str            # a note ("unavailable: ...") where the system did not run
    engine: EngineShare | None
    load_average: float               # the machine's 1-min load average once the level was done


def results_table(rows: list[Row]) -> str:
    lines = ["| system | C | requests | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | output tok/s | requests/s "
             "| tokens/request | mean decode batch | engine ms a step: model / epilogue / own | load average |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r.figures
        if isinstance(f, str):
            lines.append(f"| {r.system} | {r.concurrency} | – | {f} | | | | | | | | |")
            continue
        e = r.engine
        lanes, step = (f"{e.lanes:.1f}", f"{e.model_ms:.1f} / {e.epilogue_ms:.1f} / {e.own_ms:.1f}") if e else ("–", "–")
        lines.append(f"| {r.system} | {r.concurrency} | {r.requests} | {1e3 * f.ttft_p50:.0f} | {1e3 * f.ttft_p99:.0f} "
                     f"| {1e3 * f.tpot_p50:.1f} | {f.tokens_per_s:.1f} | {f.requests_per_s:.2f} "
                     f"| {'/'.join(map(str, f.tokens))} | {lanes} | {step} | {r.load_average:.1f} |")
    return "\n".join(lines)


def targets_table(figures: dict[tuple[str, int], Figures]) -> str:
    """The three targets as ratios, where this run measured both sides."""
    checks = [(1, "TPOT p50, serve ÷ engine.generate", "engine", lambda f: f.tpot_p50, "≤ 1.1x", lambda r: r <= 1.1),
              (16, "output tok/s, serve ÷ llama.cpp server", "llamacpp", lambda f: f.tokens_per_s, "≥ 3x",
               lambda r: r >= 3),
              (32, "output tok/s, serve ÷ engine.generate", "engine", lambda f: f.tokens_per_s, "≥ 0.85x",
               lambda r: r >= 0.85)]
    lines = ["| C | ratio | measured | target | met |", "|---|---|---|---|---|"]
    for c, what, other, figure, goal, met in checks:
        serve, ref = figures.get(("serve", c)), figures.get((other, c))
        if serve is None or ref is None:
            lines.append(f"| {c} | {what} | not measured | {goal} | – |")
            continue
        ratio = figure(serve) / figure(ref)
        lines.append(f"| {c} | {what} | {ratio:.2f}x | {goal} | {'yes' if met(ratio) else 'no'} |")
    return "\n".join(lines)


# ---- the run ---------------------------------------------------------------------------------------

def llama_cpp_unavailable() -> str | None:
    """Why llama-cpp-python's server cannot run here (None: it can)."""
    try:
        import llama_cpp.server.app  # noqa: F401  (the [server] extra: fastapi, sse-starlette, ...)
    except ImportError as e:
        return f"unavailable: {e} (pip install 'llama-cpp-python[server]==0.3.36')"
    return None


class Systems:
    """The systems of one run: `load` measures one of them at one concurrency."""

    def __init__(self, server: Any, engine: Any, llama_url: str | None, max_tokens: int) -> None:
        """`engine`: the Engine engine.generate runs on (the served one, or one of the same settings
        in this process when the served one runs in its own actor)."""
        self.max_tokens = max_tokens
        self.engine, self.runtime = engine, server.runtime
        # the body fields that make every reply max_tokens long, greedy; llama.cpp's API also has a
        # repeat penalty (1.1 by default) that pie serve's lacks: off, for the same work a token
        self.servers = {"serve": (server.url, {"ignore_eos": True})}
        if llama_url is not None:
            self.servers["llamacpp"] = (llama_url, {"min_tokens": max_tokens, "repeat_penalty": 1.0})
        # the clients run in a process of their own: in this one they would share the GIL with pie
        # serve's HTTP layer and engine, which llama.cpp's server (a process) does not
        self.clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def load(self, system: str, concurrency: int, requests: int, first_index: int) -> Load:
        if system == "engine":
            return engine_load(self.engine, concurrency, requests, self.max_tokens, first_index)
        url, extra = self.servers[system]
        before = engine_snapshot(self.runtime.stats())
        # llama.cpp's server answers any model name with the one model it serves
        load = self.clients.submit(drive, url, "default", concurrency, requests, self.max_tokens, extra,
                                   first_index).result()
        return Load(load.streams, load.wall, engine_share(self.runtime.stats(), before) if system == "serve" else None)

    def usage(self, system: str) -> tuple[int, int]:
        """(prompt, completion) tokens of one unstreamed reply, as the server counts them."""
        import openai

        url, extra = self.servers[system]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="default", messages=messages(0), max_tokens=self.max_tokens,
                                               temperature=0, extra_body=extra)
        return reply.usage.prompt_tokens, reply.usage.completion_tokens

    def close(self) -> None:
        self.clients.shutdown(wait=False, cancel_futures=True)   # a stream in flight ends with its server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma list of concurrent clients")
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens of every request")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--dtype", default="bfloat16", help="the engine's dtype (llama.cpp runs F16)")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="the engine's compiled decode (pie serve's default: auto, on for this CPU when it has AVX2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="CPU threads of the engine and of llama.cpp (default: every core)")
    ap.add_argument("--pin-cores", default="on", choices=("on", "off"),
                    help="the served engine's pin_cores (cpu_cores.py: with --threads below the cores, its "
                         "model thread on cores of its own and the host processes off them)")
    ap.add_argument("--cluster", action="store_true",
                    help="pie serve on a Ray cluster of its own (what `pie serve` runs without --local: the "
                         "engine in its actor, each request an inferlet actor from a warm pool of C+2), with "
                         "engine.generate on an engine of the same settings in this process")
    ap.add_argument("--one-process", action="store_true",
                    help="pie serve's engine in this process (`pie serve --local --one-process`) instead of a "
                         "child process of its own, and engine.generate on it")
    ap.add_argument("--quick", action="store_true", help="32 tokens, C requests a level (at least 4): a smoke run")
    add_output_options(ap, "pie serve under load")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    systems = args.systems.split(",")
    max_tokens = 32 if args.quick else args.tokens

    def requests(c: int) -> int:
        return max(c, 4) if args.quick else max(2 * c, 8)

    from pie_actors.config import load
    from pie_actors.gpu.engine import Engine
    from pie_actors.serve import Server

    # a kill (a timeout's TERM) unwinds like Ctrl-C, so that no llama.cpp server or clients are left
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    skipped = {"llamacpp": llama_cpp_unavailable()} if "llamacpp" in systems else {}
    if skipped.get("llamacpp"):
        print(f"llama.cpp's server is left out: {skipped['llamacpp']}", file=sys.stderr)
    measured = [s for s in systems if not skipped.get(s)]
    rows: list[Row] = []
    figures: dict[tuple[str, int], Figures] = {}
    with contextlib.ExitStack() as stack:
        started = time.perf_counter()
        # compile only the decode buckets this run can fill (each takes minutes to compile on 2 cores)
        settings = dict(dtype=args.dtype, compile=args.compile, compile_max_batch=max(levels), num_threads=args.threads)
        cluster = {"local": False} if args.cluster else {}
        server = Server(MODEL, port=0, engine_process=not (args.cluster or args.one_process), **cluster, **settings,
                        pin_cores=args.pin_cores == "on")
        stack.callback(server.close)
        server.start().wait_ready(SERVE_START_S)
        print(f"pie serve ready in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        if not args.one_process:                  # the served engine runs elsewhere: one like it here
            engine = Engine.from_config(load(model=MODEL, **settings).engine, long_lived=True)
            stack.callback(engine.close)
        else:
            engine = server.runtime.engine
        llama_url = (stack.enter_context(llama_cpp_server(variant("F16"), args.threads))
                     if "llamacpp" in measured else None)
        bench = Systems(server, engine, llama_url, max_tokens)
        stack.callback(bench.close)
        dtype = str(bench.engine.worker.dtype).removeprefix("torch.")
        compiled = "compiled decode" if bench.engine.worker.compiled is not None else "eager decode"
        usage = {s: bench.usage(s) for s in bench.servers if s in measured}
        # warm-up: connections, the sandbox, the clients' process; on a cluster, the host actors' first runs
        warm = max(levels) if args.cluster else 2
        for system in measured:
            bench.load(system, warm, warm, 1)
        load_before = os.getloadavg()[0]
        index = 1000                              # every request a chat of its own, across levels
        for c in levels:
            n = requests(c)
            for system in systems:
                if system not in measured:
                    rows.append(Row(system, c, n, skipped[system], None, os.getloadavg()[0]))
                    continue
                load = bench.load(system, c, n, index)
                index += n
                figures[system, c] = f = Figures.of(load)
                rows.append(Row(system, c, n, f, load.engine, os.getloadavg()[0]))
                print(results_table(rows[-1:]).splitlines()[-1], flush=True)
                if f.tokens != (max_tokens,):
                    raise SystemExit(f"{system} at C={c}: replies of {f.tokens} tokens, not {max_tokens}: "
                                     "the systems did not do equal work")

    llama = f", llama-cpp-python {metadata.version('llama-cpp-python')} F16 GGUF" if llama_url else ""
    counted = "; ".join(f"{s} {p}+{n}" for s, (p, n) in usage.items())
    where = ("on a Ray cluster of its own, engine.generate in the driver" if args.cluster else
             "in one process" if args.one_process else
             "with its engine in a child process, engine.generate in the driver")
    env = (f"SmolLM2-135M-Instruct, {args.threads} thread{'s' if args.threads > 1 else ''}; pie serve {where}, "
           f"pin_cores {args.pin_cores}; "
           f"pie serve and engine.generate {dtype}, {compiled}{llama}; "
           f"{max_tokens} completion tokens a request, greedy; requests a level: "
           f"{', '.join(f'{requests(c)} at C={c}' for c in levels)}; one unstreamed reply's usage "
           f"(prompt+completion tokens): {counted}; 1-min load average {load_before:.1f} before the "
           f"measurements, {os.getloadavg()[0]:.1f} after")
    publish(env, f"{results_table(rows)}\n\n{targets_table(figures)}\n", args.out, args.title)


if __name__ == "__main__":
    main()
