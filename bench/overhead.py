"""Per-pass cost of the data plane: client -> engine -> result, with a dummy model whose compute is small
(`dummy-small`: 2 layers, hidden 64, 512 token ids), so the tables show what the path around the model
costs: the engine's own bookkeeping, the socket, a Ray call.

    python bench/overhead.py [--clients 1,16,64] [--passes 128] [--repeats 3] [--out bench/RESULTS.md]

Three ways to reach the same engine (dummy model, float32, CPU, 1 torch thread), side by side:
  direct  — `engine.submit` in the same process (no transport: the floor)
  socket  — EngineClient -> EngineServer in an EngineActor, one TCP connection per client (the design)
  ray     — one Ray actor method call per pass (an async actor wrapping the engine)
Each of N concurrent clients (coroutines on the driver's event loop) decodes `--passes` one-token
passes with the argmax epilogue on its own sequence; sequences are created and prefilled before the
clock starts. passes/s = N x passes / wall time; µs per pass = its inverse; round trip = the time one
client waits per pass. Median of `--repeats` runs, after a warm-up run. The second table splits the
engine's executed steps (its `step_seconds`) per lane: planning (scheduler, page tables), the model
forward, the epilogues, and finishing (commits, futures); plan + finish is the engine's own cost, in
wall time and in the engine thread's CPU time (what it takes less its waits for the interpreter lock
and the cores, which the clients' threads and the data plane's loop share with it).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import time
from typing import Awaitable, Callable

import ray
import uvloop
from report import add_output_options, publish

from pie_actors.config import load
from pie_actors.gpu.engine import Engine, Lane, PassRequest
from pie_actors.gpu.engine.epilogues import ROWS_EPILOGUES, SIMPLE_EPILOGUES
from pie_actors.gpu.engine.actor import start_engine_actor
from pie_actors.inferlet.engine_client import EngineClient
from pie_actors.model_store import resolve_model

# eager in both paths: the engine actor is long-lived, so compile "auto" would compile it alone
ENGINE = dict(device="cpu", dtype="float32", num_pages=2048, num_threads=1, compile="off")
VOCAB = 512          # dummy-small's
PROMPT_LEN = 4
ARGMAX = SIMPLE_EPILOGUES["argmax"]
ROWS = ROWS_EPILOGUES["argmax"]     # as the data plane sets it: one argmax a batch

# A client: (create + prefill a sequence -> seq, decode one token on seq -> token, free seq)
Client = tuple[Callable[[list[int]], Awaitable[int]], Callable[[int, int], Awaitable[int]],
               Callable[[int], Awaitable[None]]]


class RayForward:
    """The alternative to the socket: every pass is a Ray method call."""

    def __init__(self, model_dir: str):
        self.engine = Engine.from_model(model_dir, **ENGINE).start()

    async def create(self, prompt: list[int]) -> int:
        seq = self.engine.create_sequence()
        await self.forward(seq, prompt)
        return seq

    async def forward(self, seq: int, tokens: list[int]) -> int:
        [token] = await asyncio.wrap_future(self.engine.submit(PassRequest([Lane(seq, tokens)], ARGMAX, ROWS)))
        return token

    def free(self, seq: int) -> None:
        self.engine.free(seq)


def direct_client(engine: Engine) -> Client:
    async def forward(seq: int, tokens: list[int]) -> int:
        [token] = await asyncio.wrap_future(engine.submit(PassRequest([Lane(seq, tokens)], ARGMAX, ROWS)))
        return token

    async def create(prompt: list[int]) -> int:
        seq = engine.create_sequence()
        await forward(seq, prompt)
        return seq

    async def free(seq: int) -> None:
        engine.free(seq)
    return create, forward, free


def socket_client(client: EngineClient) -> Client:
    async def create(prompt: list[int]) -> int:
        seq = await client.create()
        await client.forward([{"seq": seq, "tokens": prompt}])
        return seq

    async def forward(seq: int, tokens: list[int]) -> int:
        [token] = await client.forward([{"seq": seq, "tokens": tokens}])
        return token
    return create, forward, client.free


def ray_client(actor) -> Client:
    async def create(prompt: list[int]) -> int:
        return await actor.create.remote(prompt)

    async def forward(seq: int, tokens: list[int]) -> int:
        return await actor.forward.remote(seq, tokens)

    async def free(seq: int) -> None:
        await actor.free.remote(seq)
    return create, forward, free


async def run_once(clients: list[Client], passes: int) -> float:
    """Seconds for every client to decode `passes` tokens, all clients at once."""
    rng = random.Random(0)
    seqs = await asyncio.gather(*(c[0]([rng.randrange(17, VOCAB) for _ in range(PROMPT_LEN)]) for c in clients))

    async def decode(client: Client, seq: int) -> None:
        token = 17
        for _ in range(passes):
            token = await client[1](seq, [token])

    start = time.perf_counter()
    await asyncio.gather(*(decode(c, s) for c, s in zip(clients, seqs)))
    elapsed = time.perf_counter() - start
    await asyncio.gather(*(c[2](s) for c, s in zip(clients, seqs)))
    return elapsed


async def bench(model_dir: str, counts: list[int], passes: int, repeats: int
                ) -> tuple[dict[tuple[int, str], float], dict[tuple[int, str], dict[str, float]]]:
    """(clients, mode) -> seconds for clients x passes passes; and, for the direct and socket modes,
    the engine's step seconds per lane by part over those runs."""
    engine = Engine.from_model(model_dir, **ENGINE).start()
    actor, address = start_engine_actor(load(model=model_dir, **ENGINE).engine, host="127.0.0.1")
    forwarder = ray.remote(num_cpus=0)(RayForward).remote(model_dir)
    stats = {"direct": lambda: {"step_seconds": dict(engine.step_seconds), "batch_sizes": dict(engine.batch_sizes)},
             "socket": lambda: ray.get(actor.stats.remote())}
    results, parts = {}, {}
    for n in counts:
        connections = [await EngineClient.connect(*address) for _ in range(n)]
        modes = {"direct": [direct_client(engine)] * n,
                 "socket": [socket_client(c) for c in connections],
                 "ray": [ray_client(forwarder)] * n}
        for mode, clients in modes.items():
            # warm-up, outside the step figures: connections, allocator, code paths, the first
            # epilogue's one-off kernel load
            await run_once(clients, max(4, passes // 8))
            before = stats[mode]() if mode in stats else None
            results[n, mode] = statistics.median([await run_once(clients, passes) for _ in range(repeats)])
            if before is not None:
                parts[n, mode] = per_lane(before, stats[mode]())
            print(f"  {n} clients, {mode}: {n * passes / results[n, mode]:.0f} passes/s", file=sys.stderr)
        for c in connections:
            await c.close()
    engine.close()
    return results, parts


def per_lane(before: dict, after: dict) -> dict[str, float]:
    """µs per executed lane of each part of the steps run between two stats snapshots."""
    lanes = sum(int(k) * (v - before["batch_sizes"].get(k, 0)) for k, v in after["batch_sizes"].items())
    parts = {part: (after["step_seconds"].get(part, 0) - before["step_seconds"].get(part, 0)) / lanes * 1e6
             for part in ("plan", "model", "epilogue", "finish", "plan_cpu", "finish_cpu")}
    return parts | {"lanes": lanes / (after["step_seconds"]["steps"] - before["step_seconds"].get("steps", 0))}


def parts_table(parts: dict[tuple[int, str], dict[str, float]]) -> str:
    lines = ["| clients | path | lanes a step | plan µs/lane | model µs/lane | epilogue µs/lane | finish µs/lane "
             "| engine's own (plan + finish) µs/lane | its engine-thread CPU µs/lane |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (n, mode), p in parts.items():
        lines.append(f"| {n} | {mode} | {p['lanes']:.1f} | {p['plan']:.1f} | {p['model']:.1f} | {p['epilogue']:.1f} | "
                     f"{p['finish']:.1f} | {p['plan'] + p['finish']:.1f} | {p['plan_cpu'] + p['finish_cpu']:.1f} |")
    return "\n".join(lines)


def table(results: dict[tuple[int, str], float], passes: int) -> str:
    lines = ["| clients | path | passes/s | µs per pass | round trip µs | × direct |", "|---|---|---|---|---|---|"]
    for (n, mode), seconds in results.items():
        total = n * passes
        ratio = seconds / results[n, "direct"]
        lines.append(f"| {n} | {mode} | {total / seconds:,.0f} | {seconds / total * 1e6:,.0f} | "
                     f"{seconds / passes * 1e6:,.0f} | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,16,64", help="comma list of concurrent client counts")
    ap.add_argument("--passes", type=int, default=128, help="one-token passes per client per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="dummy-small", help="dummy-small, or dummy (the default model's 49,152-row head)")
    add_output_options(ap, "Data plane overhead")
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))

    load_before = os.getloadavg()[0]
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        results, parts = uvloop.run(bench(model_dir, [int(n) for n in args.clients.split(",")], args.passes,
                                          args.repeats))
    finally:
        ray.shutdown()
    env = (f"{platform.machine()}, {os.cpu_count()} cores, Ray {ray.__version__}, uvloop {uvloop.__version__}; "
           f"{args.model} model (2 layers, hidden 64), float32, eager, 1 torch thread per engine; {args.passes} passes per "
           f"client, median of {args.repeats}; 1-min load average {load_before:.1f} before, "
           f"{os.getloadavg()[0]:.1f} after")
    report = table(results, args.passes) + "\n\n" + parts_table(parts) + "\n"
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
