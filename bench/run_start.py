"""A run's start in the sandbox, its main module compiled in each run against handed over as the
runner compiled it in an earlier run (`Sandbox`'s kept code): the CPU from `Sandbox.run` to the
program's first host operation, for a short program, a longer one and pie serve's chat endpoint;
and beside Python's, the same programs written in JavaScript on the JavaScript runner (examples/js:
the quickstart, top-a and the serve endpoint), whose main module is evaluated at each run, rewritten
in each run or handed over as an earlier run rewrote it.

    python bench/run_start.py [--runs 40] [--out bench/RESULTS.md]

Each run is a fresh instance of the runner in a pooled slot; it ends at its first host operation
(model, chat, ...), so what is measured is instantiation, the runner's start, the main module's
compile or its code's unmarshalling, and the module's code up to that call. Two Sandboxes of the
runner take turns in one process, one keeping no code (`codes_kept=0`: each run compiles, as every
run did before runs were handed the code), one keeping it (the first run compiles, the rest are
handed the code); two of the JavaScript runner, one keeping no rewritten module and one keeping
them, run the JavaScript twins. No engine is involved: the host operation ends the run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from report import add_output_options, publish

from pie_actors.inferlet import HostApi, InferletError, Sandbox
from pie_actors.inferlet.build import ensure_js_runner

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# program -> its Python source, and its JavaScript twin (None: none)
PROGRAMS = {"examples/completion_max": (EXAMPLES / "completion_max" / "main.py", None),
            "examples/run_ahead": (EXAMPLES / "run_ahead" / "main.py", None),
            "pie serve's chat endpoint": (ROOT / "pie_actors" / "serve" / "endpoints" / "chat.py", None),
            "examples/quickstart": (EXAMPLES / "quickstart" / "main.py", EXAMPLES / "js" / "quickstart" / "main.js"),
            "examples/top_a": (EXAMPLES / "top_a" / "main.py", EXAMPLES / "js" / "top_a" / "main.js"),
            "examples/serve_endpoint": (EXAMPLES / "serve_endpoint" / "main.py",
                                        EXAMPLES / "js" / "serve_endpoint" / "main.js")}
JAVASCRIPT = ("JavaScript, rewritten each run", "JavaScript, rewrite handed over")
HANDED_OVER = ("handed over", JAVASCRIPT[1])


class _FirstCall(HostApi):
    """Notes the thread's CPU at the run's first host operation and ends the run there."""

    def call(self, op, args):
        self.cpu = time.thread_time()
        raise InferletError("cancelled", "the measured start is over")


def _start_cpu(sandbox: Sandbox, source: str) -> tuple[float, bool]:
    api, stats = _FirstCall(), {}
    c0 = time.thread_time()
    try:
        sandbox.run(source, {}, api, stats=stats)
    except InferletError as e:
        assert e.kind == "cancelled", e      # the program reached its first host operation
    return api.cpu - c0, stats["main_cached"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40, help="runs of each program on each side, alternating")
    add_output_options(ap, "A run's start: the main module compiled once")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    sides = {"compiled each run": Sandbox(codes_kept=0), "handed over": Sandbox(),
             JAVASCRIPT[0]: Sandbox(runner=ensure_js_runner, codes_kept=0),
             JAVASCRIPT[1]: Sandbox(runner=ensure_js_runner)}
    rows = []
    for name, (python, javascript) in PROGRAMS.items():
        sources = {side: (javascript if side in JAVASCRIPT else python) for side in sides}
        sources = {side: path.read_text(encoding="utf-8") for side, path in sources.items() if path is not None}
        for side, source in sources.items():          # warm: the pool's slot, and the kept code
            _start_cpu(sides[side], source)
        cpu: dict[str, list[float]] = {side: [] for side in sources}
        for _ in range(args.runs):
            for side, source in sources.items():
                spent, cached = _start_cpu(sides[side], source)
                assert cached == (side in HANDED_OVER)
                cpu[side].append(spent)
        base = statistics.median(cpu["compiled each run"])
        for side, spent in cpu.items():
            ms = statistics.median(spent)
            kb = len(sources[side]) / 1024
            rows.append(f"| {name} | {kb:.1f} | {side} | {ms * 1e3:.2f} | {ms / base:.2f} |")
    report = "\n".join(["| program | source kB | main module | CPU to the first host operation, ms (median) "
                        "| ÷ Python compiled each run |", "|---|---|---|---|---|", *rows]) + "\n"
    env = (f"runner components (Python's, JavaScript's) in pooled slots; {args.runs} runs a program a side, "
           "the sides alternating; "
           f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
