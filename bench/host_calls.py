"""What one crossing of the sandbox's host boundary costs, with each import glue.

    python bench/host_calls.py [--calls 20000] [--rounds 3] [--out bench/RESULTS.md]

A guest loops over each host import of wit/inferlet.wit (`call` answered and refused, `send`,
`poll`, `wait-any` with a 0 ms timeout) and times it; a host whose operations do nothing answers.
The arms: the imports registered with wasmtime's C API by inferlet/wasm_imports.py (`direct`, the
default) and through wasmtime-py's generic `add_func` (`PIE_WASM_IMPORTS=generic`), each in a fresh
process, interleaved round by round. Per import: µs a call (the median over the rounds; the guest's
JSON and the host's dispatch included) and the ratio generic ÷ direct.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from report import add_output_options, publish

ROOT = Path(__file__).resolve().parent.parent
IMPORTS = ["call", "call refused", "send", "poll", "wait-any"]
GUEST = """
import time
from inferlet import _host, HostError
from wit_world.imports import host as _wit

async def main(input):
    n, out = input["n"], {}

    def timed(name, f):
        t = time.perf_counter()
        for _ in range(n):
            f()
        out[name] = (time.perf_counter() - t) / n * 1e6

    def refused():
        try:
            _host.call("no-such-op", None)
        except HostError:
            pass
    timed("call", lambda: _host.call("echo", [1, 2, 3]))
    timed("call refused", refused)
    timed("send", lambda: _wit.send("x"))
    timed("poll", lambda: _wit.poll("[]"))
    timed("wait-any", lambda: _wit.wait_any("[]", 0))
    return out
"""
ARM = """
import json, sys
from pie_actors.inferlet import HostApi, Sandbox

class Echo(HostApi):
    def call(self, op, args):
        return args if op == "echo" else super().call(op, args)

    def send(self, message):
        pass

sandbox = Sandbox()
sandbox.run(sys.argv[1], {"n": 500}, Echo())                   # warm-up
print(json.dumps(sandbox.run(sys.argv[1], {"n": int(sys.argv[2])}, Echo())))
"""


def arm(glue: str, calls: int) -> dict[str, float]:
    env = {**os.environ, "PIE_WASM_IMPORTS": glue}
    out = subprocess.run([sys.executable, "-c", ARM, GUEST, str(calls)], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    add_output_options(ap, "Host calls: direct import glue vs wasmtime-py's")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"direct": [], "generic": []}
    for _ in range(args.rounds):
        for glue in runs:
            runs[glue].append(arm(glue, args.calls))
    median = {glue: {name: statistics.median(r[name] for r in rs) for name in IMPORTS} for glue, rs in runs.items()}
    rows = ["| import | direct µs a call | generic µs a call | generic ÷ direct |", "|---|---|---|---|"]
    for name in IMPORTS:
        d, g = median["direct"][name], median["generic"][name]
        rows.append(f"| {name} | {d:.1f} | {g:.1f} | {g / d:.2f} |")
    env = (f"{args.calls} calls an import, median of {args.rounds} rounds a glue, each in a fresh process; "
           f"1-min load average {os.getloadavg()[0]:.1f}")
    publish(env, "\n".join(rows), args.out, args.title)


if __name__ == "__main__":
    main()
