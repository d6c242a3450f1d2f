"""N programs at once on one engine: what the path programs take costs against the engine's own
batched decode, run the way users run them.

    python bench/concurrency.py [--clients 1,8,32,64] [--tokens 64] [--paths local,ray]
                                [--engines eager,compiled] [--dtype auto] [--out bench/RESULTS.md]

For each engine (eager, compiled decode) and path (`Runtime.local`: sandbox, data plane and engine in
this process; `Runtime.connect`: inferlet actors and an engine actor on a local Ray cluster), N
programs are launched at once, each greedy-decoding `--tokens` tokens of its own ~30-token prompt:
  per-token  one pass per token, as the quickstart decodes (examples/completion_max)
  run-ahead  a device loop, the host reading tokens (examples/run_ahead, stop tokens ignored)
against `engine.generate` of the same N prompts batched in this process, measured in the same run
(the Ray rows are compared with it too: same engine settings, same machine). Wall time runs from the
first launch to the last result; tokens/s = N x tokens / wall time. Per row: the ratio to
engine.generate, the decode-step histogram (lanes: steps) from the engine's statistics, and, in
process, the CPU time per token of the program side (the sandboxed guest and its host: the threads
each run starts) and of the data plane's server thread.
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from report import add_output_options, publish

from pie_actors import Program, Runtime

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LOOPS = {"per-token": Program.load(EXAMPLES / "completion_max"),
         "run-ahead": Program.load((EXAMPLES / "run_ahead" / "main.py").read_text().replace(
             "tokens[-1] not in stop and len(tokens) < max_tokens", "len(tokens) < max_tokens"))}
STORY = " once upon a time, in a small village by the sea, there lived an old fisherman who"
_TICK = os.sysconf("SC_CLK_TCK")


def prompts(n: int) -> list[str]:
    return [f"Story {i}:{STORY}" for i in range(n)]


def _task_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process, by thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue                          # it ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def _thread_id(name: str) -> int | None:
    return next((t.native_id for t in threading.enumerate() if t.name == name), None)


def run_batch(runtime: Runtime, program: Program, n: int, tokens: int) -> dict:
    """N programs launched at once; wall time, decode-step histogram and (in process) CPU."""
    before = runtime.stats()["decode_batch_sizes"]
    cpu0, tasks0 = time.process_time(), _task_cpu()
    t0 = time.perf_counter()
    processes = [runtime.launch(program, {"prompt": p, "max_tokens": tokens}) for p in prompts(n)]
    outputs = [p.result() for p in processes]
    wall = time.perf_counter() - t0
    cpu, tasks = time.process_time() - cpu0, _task_cpu()
    assert all(len(o["tokens"] if "tokens" in o else o["text"]) for o in outputs)
    steps = {k: v - before.get(k, 0) for k, v in runtime.stats()["decode_batch_sizes"].items()
             if v - before.get(k, 0)}
    # threads alive before and after are the engine's, its kernels' and the data plane's; the rest
    # were started by the runs (the guest's and its host's)
    lasting = sum(tasks[t] - tasks0[t] for t in tasks if t in tasks0)
    server = _thread_id("engine-server")
    plane = tasks.get(server, 0.0) - tasks0.get(server, 0.0) if server else 0.0
    return {"wall": wall, "steps": steps, "host_cpu": cpu - lasting, "plane_cpu": plane}


def reference(runtime: Runtime, n: int, tokens: int) -> float:
    engine = runtime.engine
    encoded = [engine.tokenizer.encode(p) for p in prompts(n)]
    engine.generate(encoded, 2, ignore_eos=True)                   # warm-up (compiled buckets)
    t0 = time.perf_counter()
    engine.generate(encoded, tokens, ignore_eos=True)
    return n * tokens / (time.perf_counter() - t0)


def histogram(steps: dict[int, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(steps.items(), reverse=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--paths", default="local,ray")
    ap.add_argument("--engines", default="eager,compiled")
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--dtype", default="auto")
    add_output_options(ap, "Programs at once vs engine.generate")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    loops = args.loops.split(",")

    rows = ["| engine | path | loop | N | tokens/s | ÷ generate | decode steps (lanes:steps) "
            "| host CPU ms/token | data plane ms/token |", "|---|---|---|---|---|---|---|---|---|"]
    load_before = os.getloadavg()[0]
    for kind in args.engines.split(","):
        settings = {"dtype": args.dtype, "compile": kind == "compiled"}
        with Runtime.local(**settings) as local:
            dtype = str(local.engine.worker.dtype).removeprefix("torch.")
            generate = {n: reference(local, n, args.tokens) for n in clients}
            for n in clients:
                rows.append(f"| {kind} | engine.generate | – | {n} | {generate[n]:.1f} | 1.00 | – | – | – |")
            if "local" in args.paths:
                rows += measure(kind, "local", local, loops, clients, args.tokens, generate)
        if "ray" in args.paths:
            import ray
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
            try:
                with Runtime.connect(**settings) as cluster:
                    rows += measure(kind, "ray", cluster, loops, clients, args.tokens, generate)
            finally:
                ray.shutdown()
    env = (f"SmolLM2-135M-Instruct, {dtype}; {args.tokens} new tokens a program, prompts of ~30 tokens; "
           f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, "\n".join(rows), args.out, args.title)


def measure(kind: str, path: str, runtime: Runtime, loops: list[str], clients: list[int], tokens: int,
            generate: dict[int, float]) -> list[str]:
    rows = []
    for loop in loops:
        run_batch(runtime, LOOPS[loop], 2, 4)                          # warm-up: sandbox, programs
        for n in clients:
            r = run_batch(runtime, LOOPS[loop], n, tokens)
            rate = n * tokens / r["wall"]
            cpu = (f"{1e3 * r['host_cpu'] / (n * tokens):.2f} | {1e3 * r['plane_cpu'] / (n * tokens):.2f}"
                   if path == "local" else "– | –")
            rows.append(f"| {kind} | {path} | {loop} | {n} | {rate:.1f} | {rate / generate[n]:.2f} "
                        f"| {histogram(r['steps'])} | {cpu} |")
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
