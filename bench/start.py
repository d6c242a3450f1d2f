"""Start time of a compiled engine, cold (empty caches) and warm (a second start on this machine),
beside an eager engine's start.

    python bench/start.py [--model smollm2-135m-instruct] [--max-batch 8] [--out bench/RESULTS.md]

Each start is a fresh Python process that builds `Engine.from_model(model, compile=...)`, warm-up
included (every decode bucket up to --max-batch), and prints its seconds and which buckets it
compiled and which it loaded. The runs share a scratch $PIE_HOME whose models/ is this machine's, so
the cold start finds no compiled packages or inductor caches and the warm one finds what the cold one
wrote.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from report import add_output_options, publish

from pie_actors.config import pie_home

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from pie_actors.gpu.engine import Engine
engine = Engine.from_model(sys.argv[1], compile=sys.argv[2], compile_max_batch=int(sys.argv[3]), progress=False)
compiled = engine.worker.compiled
assert (compiled is not None) == (sys.argv[2] == "on")
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "buckets compiled": compiled.compiled_now if compiled else [],
                  "buckets loaded": compiled.loaded if compiled else []}))
"""


def start(model: str, compile: str, max_batch: int, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", CHILD, model, compile, str(max_batch)], env={**env, "PIE_HOME": str(home)},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-batch", type=int, default=8, help="compile_max_batch: the buckets warmed up")
    add_output_options(ap, "Compiled engine start")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        home = Path(scratch)
        (home / "models").symlink_to(pie_home() / "models")
        runs = {"eager": start(args.model, "off", args.max_batch, home),
                "compiled, cold": start(args.model, "on", args.max_batch, home),
                "compiled, warm": start(args.model, "on", args.max_batch, home)}
    cold = runs["compiled, cold"]["seconds"]
    rows = ["| start | seconds | ÷ cold | buckets compiled | buckets loaded |", "|---|---|---|---|---|"]
    for name, run in runs.items():
        compiled, loaded = (", ".join(map(str, run[k])) or "–" for k in ("buckets compiled", "buckets loaded"))
        rows.append(f"| {name} | {run['seconds']:.1f} | {run['seconds'] / cold:.2f} | {compiled} | {loaded} |")
    env = (f"{args.model}, auto dtype, decode buckets up to {args.max_batch} lanes; a fresh process a start; "
           f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, "\n".join(rows), args.out, args.title)


if __name__ == "__main__":
    main()
