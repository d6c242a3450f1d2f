"""A run's host CPU with the memory image's written pages copied in ahead, and without
(pie_actors/inferlet/image_pages.py): N one-pass-per-token programs at once on `Runtime.local`,
rounds alternating between the two in one process, for a short program and a longer one.

    python bench/image_pages.py [--clients 32] [--tokens 2,64] [--rounds 4] [--out bench/RESULTS.md]

A run's CPU and minor page faults are its thread's (`RUSAGE_THREAD`) from the start of
`Sandbox.run` to its end: instantiation, the copying ahead, the guest and its host calls. The
batch time is launch to the last result. The copying is switched by emptying the learned pages
(`ImagePages.ranges`) for the rounds without it, so both sides share the process, the engine and
the warm caches.
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
from pie_actors.inferlet import host
from pie_actors.inferlet.image_pages import ImagePages

RUNS: list[tuple[float, int]] = []      # (thread CPU s, minor faults) of each run since the last clear


def _measured(run):
    def measured(self, *args, **kwargs):
        r0, c0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
        try:
            return run(self, *args, **kwargs)
        finally:
            RUNS.append((time.thread_time() - c0, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - r0))
    return measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", default="2,64")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each side, alternating")
    add_output_options(ap, "Sandbox memory: image pages copied ahead")
    args = ap.parse_args()
    host.Sandbox.run = _measured(host.Sandbox.run)
    program = LOOPS["per-token"]
    load_before = os.getloadavg()[0]
    rows = []
    with Runtime.local(dtype="float32", compile="off") as runtime:
        [p.result() for p in [runtime.launch(program, {"prompt": t, "max_tokens": 4}) for t in prompts(4)]]
        pages = next(p for p in ImagePages._all.values() if p.watched)
        learned = pages.ranges
        for tokens in [int(t) for t in args.tokens.split(",")]:
            sides: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
            for i in range(2 * args.rounds):
                ahead = i % 2 == 0
                pages.ranges = learned if ahead else []
                RUNS.clear()
                t0 = time.perf_counter()
                [p.result() for p in [runtime.launch(program, {"prompt": t, "max_tokens": tokens})
                                      for t in prompts(args.clients)]]
                sides[ahead].append((time.perf_counter() - t0, statistics.median(c for c, _ in RUNS),
                                     statistics.median(f for _, f in RUNS)))
            pages.ranges = learned
            med = {ahead: [statistics.median(r[k] for r in runs) for k in range(3)] for ahead, runs in sides.items()}
            for ahead in (False, True):
                wall, cpu, faults = med[ahead]
                rows.append(f"| {tokens} | {'yes' if ahead else 'no'} | {wall:.2f} | {cpu * 1e3:.1f} | {faults:.0f} | "
                            f"{cpu / med[False][1]:.2f} | {wall / med[False][0]:.2f} |")
    report = "\n".join(["| tokens a program | copied ahead | batch s | a run's host CPU ms | minor faults a run "
                        "| CPU ÷ not copied | batch ÷ not copied |", "|---|---|---|---|---|---|---|", *rows]) + "\n"
    env = (f"{args.clients} one-pass-per-token programs (examples/completion_max) at once, SmolLM2-135M-Instruct "
           f"float32, eager; {sum(n for _, n in learned)} image pages learned ({len(learned)} runs of pages); "
           f"medians of {args.rounds} rounds a side, alternating; 1-min load average {load_before:.1f} before, "
           f"{os.getloadavg()[0]:.1f} after")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
