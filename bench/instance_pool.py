"""A run's host CPU with the sandbox's instances in pooled slots, and mapped anew for each run
(pie_actors/inferlet/instance_pool.py): N one-pass-per-token programs at once on `Runtime.local`,
rounds alternating between the two in one process, for a short program and a longer one.

    python bench/instance_pool.py [--clients 32] [--tokens 2,64] [--rounds 4] [--out bench/RESULTS.md]

A run's CPU and minor page faults are its thread's (`RUSAGE_THREAD`) from the start of
`Sandbox.run` to its end: instantiation, the guest and its host calls, the instance's release. The
batch time is launch to the last result; the time to the last first pass is when the engine had
every program's first pass (all of them starting at once). The runs' Sandbox is switched between
rounds (one on the process's pooled engine, one on an engine without a pool), so both sides share
the process, the model engine and the warm caches.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

from concurrency import LOOPS, prompts
from report import add_output_options, publish

from pie_actors import Runtime
from pie_actors.gpu.engine import scheduler
from pie_actors.inferlet import host, run
from pie_actors.inferlet.build import new_engine

RUNS: list[tuple[float, int]] = []      # (thread CPU s, minor faults) of each run since the last clear
FIRST_PASSES: list[float] = []          # when the engine had a program's first pass, since the last clear


def _measured(run):
    def measured(self, *args, **kwargs):
        r0, c0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
        try:
            return run(self, *args, **kwargs)
        finally:
            RUNS.append((time.thread_time() - c0, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - r0))
    return measured


def _noted(arrived):
    def noted(self, owner, now):
        if owner is not None and owner not in self.known:
            FIRST_PASSES.append(time.perf_counter())
        arrived(self, owner, now)
    return noted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", default="2,64")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each side, alternating")
    add_output_options(ap, "Sandbox memory: pooled instance slots")
    args = ap.parse_args()
    host.Sandbox.run = _measured(host.Sandbox.run)
    scheduler.Arrivals.arrived = _noted(scheduler.Arrivals.arrived)
    program = LOOPS["per-token"]
    load_before = os.getloadavg()[0]
    rows = []
    with Runtime.local(dtype="float32", compile="off") as runtime:
        sandboxes = {True: host.Sandbox(), False: host.Sandbox(engine=new_engine(slots=0))}
        for sandbox in sandboxes.values():
            run._sandboxes[None] = sandbox
            [p.result() for p in [runtime.launch(program, {"prompt": t, "max_tokens": 4}) for t in prompts(4)]]
        for tokens in [int(t) for t in args.tokens.split(",")]:
            sides: dict[bool, list[tuple[float, ...]]] = {True: [], False: []}
            for i in range(2 * args.rounds):
                pooled = i % 2 == 0
                run._sandboxes[None] = sandboxes[pooled]
                RUNS.clear()
                FIRST_PASSES.clear()
                t0 = time.perf_counter()
                [p.result() for p in [runtime.launch(program, {"prompt": t, "max_tokens": tokens})
                                      for t in prompts(args.clients)]]
                sides[pooled].append((time.perf_counter() - t0, max(FIRST_PASSES) - t0,
                                      statistics.median(c for c, _ in RUNS), statistics.median(f for _, f in RUNS)))
            run._sandboxes[None] = sandboxes[True]
            med = {pooled: [statistics.median(r[k] for r in runs) for k in range(4)] for pooled, runs in sides.items()}
            for pooled in (False, True):
                wall, first, cpu, faults = med[pooled]
                side = "pooled" if pooled else "mapped anew"
                rows.append(f"| {tokens} | {side} | {wall:.2f} | {first * 1e3:.0f} | {cpu * 1e3:.1f} | {faults:.0f} | "
                            f"{cpu / med[False][2]:.2f} | {wall / med[False][0]:.2f} |")
    report = "\n".join(["| tokens a program | instances | batch s | last first pass ms | a run's host CPU ms "
                        "| minor faults a run | CPU ÷ mapped anew | batch ÷ mapped anew |",
                        "|---|---|---|---|---|---|---|---|", *rows]) + "\n"
    env = (f"{args.clients} one-pass-per-token programs (examples/completion_max) at once, SmolLM2-135M-Instruct "
           f"float32, eager; medians of {args.rounds} rounds a side, alternating; 1-min load average "
           f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
