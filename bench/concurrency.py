"""N programs at once on one engine: what the path programs take costs against the engine's own
batched decode, run the way users run them.

    python bench/concurrency.py [--clients 1,8,32,64] [--tokens 64] [--paths local,child,ray] [--rounds 5]
                                [--engines eager,compiled] [--dtype auto] [--out bench/RESULTS.md]

For each engine (eager, compiled decode) and path (`local`, `Runtime.local`: sandbox, data plane and
engine in this process; `child`, `Runtime.local(engine_process=True)`: the same with the engine in a
child process, as `pie serve --local` runs it; `ray`, `Runtime.connect`: inferlet actors and an
engine actor on a local Ray cluster), N programs are launched at once, each greedy-decoding
`--tokens` tokens of its own ~30-token prompt:
  per-token  one pass per token, as the quickstart decodes (examples/completion_max)
  run-ahead  a device loop, the host reading tokens (examples/run_ahead, stop tokens ignored), woken
             once per window's tokens (`wake_every=model.run_ahead_window()`)
  run-ahead/1  the same, woken for each token (`wake_every=1`), as a reader that streams them
  per-token JS, run-ahead JS  the first two written in JavaScript (examples/js), on the JavaScript runner
against `engine.generate` of the same N prompts batched in this process. The two alternate,
`--rounds` times a row, each round on prompts that neither has seen (so no prefix cache favours
either), and a row gives the median of the rounds' ratios: the machines are shared, and their speed
drifts by more than the gaps measured (five rounds: the median of three scattered by as much as the
gaps). The Ray rounds too alternate with engine.generate in this process (its engine idle
meanwhile), so the ratio of a Ray row to the local row of the same N is the cluster path against
the local one with the drift between their rounds taken out. Wall time runs from the first launch
to the last result; tokens/s = N x tokens / wall time (the median round's). Per row: the
decode-step histogram (lanes: steps) of the median round from the engine's statistics; the
engine's busy share (the part of the wall time its steps took: what the path leaves it idle is the
rest); the CPU time per token of the program side (in this process, the sandboxed guest and its
host: the threads each run starts, and the host loop they share; on the Ray path, every thread of
the host actors' processes, read from /proc); and that of the data plane's server thread (in this
process on the local path only).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import threading
import time
from pathlib import Path

from report import add_output_options, publish

from pie_actors import Program, Runtime

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_RUN_AHEAD = (EXAMPLES / "run_ahead" / "main.py").read_text().replace(
    "tokens[-1] not in stop and len(tokens) < max_tokens", "len(tokens) < max_tokens")
_RUN_AHEAD_JS = (EXAMPLES / "js" / "run_ahead" / "main.js").read_text().replace(
    "!stop.has(tokens[tokens.length - 1]) && tokens.length < maxTokens", "tokens.length < maxTokens")
LOOPS = {"per-token": Program.load(EXAMPLES / "completion_max"),
         "run-ahead": Program.load(_RUN_AHEAD),
         "run-ahead/1": Program.load(_RUN_AHEAD.replace("wake_every=model.run_ahead_window()", "wake_every=1")),
         "per-token JS": Program.load(EXAMPLES / "js" / "completion_max" / "main.js"),
         "run-ahead JS": Program(source=_RUN_AHEAD_JS, language="javascript")}
assert "wake_every=1" in LOOPS["run-ahead/1"].source and "tokens.length < maxTokens" in _RUN_AHEAD_JS
STORY = " once upon a time, in a small village by the sea, there lived an old fisherman who"
_TICK = os.sysconf("SC_CLK_TCK")
BUSY = ("plan", "model", "epilogue", "finish")     # the engine's step_seconds that add up to a step


_batches = itertools.count()


def prompts(n: int) -> list[str]:
    """N prompts no earlier call gave (the prefix cache holds none of them)."""
    batch = next(_batches)
    return [f"Story {batch}.{i}:{STORY}" for i in range(n)]


def _cpu_seconds(stat: str) -> float | None:
    """User + system CPU seconds from a /proc stat file; None once its task has ended."""
    try:
        fields = open(stat).read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


def _task_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process, by thread id."""
    cpu = {int(tid): _cpu_seconds(f"/proc/self/task/{tid}/stat") for tid in os.listdir("/proc/self/task")}
    return {tid: s for tid, s in cpu.items() if s is not None}


def _host_actors_cpu() -> dict[int, float]:
    """CPU seconds of each inferlet host actor's process on this machine, by pid (Ray titles its
    actors' processes "ray::<class>"; the bench's cluster is its own)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue                          # it ended meanwhile
        if title.startswith(b"ray::InferletActor") and (cpu := _cpu_seconds(f"/proc/{pid}/stat")) is not None:
            out[int(pid)] = cpu
    return out


def _thread_id(name: str) -> int | None:
    return next((t.native_id for t in threading.enumerate() if t.name == name), None)


def run_batch(runtime: Runtime, program: Program, n: int, tokens: int, path: str) -> dict:
    """N programs launched at once; wall time, decode-step histogram and the program side's CPU."""
    texts = prompts(n)
    before = runtime.stats()
    cpu0, tasks0 = time.process_time(), _task_cpu()
    actors0 = _host_actors_cpu() if path == "ray" else {}
    t0 = time.perf_counter()
    processes = [runtime.launch(program, {"prompt": p, "max_tokens": tokens}) for p in texts]
    outputs = [p.result() for p in processes]
    wall = time.perf_counter() - t0
    cpu, tasks = time.process_time() - cpu0, _task_cpu()
    actors = _host_actors_cpu() if path == "ray" else {}
    assert all(len(o["tokens"] if "tokens" in o else o["text"]) for o in outputs)
    after = runtime.stats()
    steps = {k: v - before["decode_batch_sizes"].get(k, 0) for k, v in after["decode_batch_sizes"].items()
             if v - before["decode_batch_sizes"].get(k, 0)}
    # the share of the wall time the engine spent running steps (planning, model, epilogues, results)
    busy = sum(after["step_seconds"].get(k, 0) - before["step_seconds"].get(k, 0) for k in BUSY) / wall
    # threads alive before and after are the engine's, its kernels' and the data plane's, and the
    # runs' shared host loop (theirs); the rest were started by the runs (each guest and its host calls)
    loop, server = _thread_id("inferlet-host"), _thread_id("engine-server")
    engine_side = sum(tasks[t] - tasks0[t] for t in tasks if t in tasks0 and t != loop)
    plane = tasks.get(server, 0.0) - tasks0.get(server, 0.0) if server else 0.0
    host = sum(s - actors0.get(pid, 0.0) for pid, s in actors.items()) if path == "ray" else cpu - engine_side
    return {"wall": wall, "steps": steps, "busy": busy, "host_cpu": host, "plane_cpu": plane}


def reference(runtime: Runtime, n: int, tokens: int) -> float:
    """engine.generate's tokens/s on N fresh prompts."""
    engine = runtime.engine
    encoded = [engine.tokenizer.encode(p) for p in prompts(n)]
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
    ap.add_argument("--rounds", type=int, default=5, help="generate/programs pairs a row (median)")
    add_output_options(ap, "Programs at once vs engine.generate")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    loops = args.loops.split(",")

    rows = ["| engine | path | loop | N | tokens/s | ÷ generate | decode steps (lanes:steps) | engine busy "
            "| host CPU ms/token | data plane ms/token |", "|---|---|---|---|---|---|---|---|---|---|"]
    load_before = os.getloadavg()[0]
    for kind in args.engines.split(","):
        settings = {"dtype": args.dtype, "compile": kind == "compiled"}
        with Runtime.local(**settings) as local:
            dtype = str(local.engine.worker.dtype).removeprefix("torch.")
            for n in clients:
                reference(local, n, 2)                                  # warm-up (compiled buckets)
            generate: dict[int, list[float]] = {n: [] for n in clients}
            program_rows = []
            if "local" in args.paths:
                program_rows += measure(kind, "local", local, local, loops, clients, args.tokens, args.rounds, generate)
            if "child" in args.paths:
                with Runtime.local(engine_process=True, **settings) as child:
                    program_rows += measure(kind, "child", child, local, loops, clients, args.tokens, args.rounds,
                                            generate)
            if "ray" in args.paths:
                import ray
                from pie_actors.runtime import start_ray

                start_ray("local")    # a cluster of its own, as Runtime.connect starts it (its workers at nice 0)
                try:
                    with Runtime.connect(**settings) as cluster:
                        program_rows += measure(kind, "ray", cluster, local, loops, clients, args.tokens,
                                                args.rounds, generate)
                finally:
                    ray.shutdown()
            for n in clients:
                rows.append(f"| {kind} | engine.generate | – | {n} | {statistics.median(generate[n]):.1f} "
                            f"| 1.00 | – | – | – | – |")
            rows += program_rows
    env = (f"SmolLM2-135M-Instruct, {dtype}; {args.tokens} new tokens a program, prompts of ~30 tokens; "
           f"median of {args.rounds} rounds a row; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, "\n".join(rows), args.out, args.title)


def measure(kind: str, path: str, runtime: Runtime, reference_runtime: Runtime, loops: list[str],
            clients: list[int], tokens: int, rounds: int, generate: dict[int, list[float]]) -> list[str]:
    """The rows of `path`. Each round runs engine.generate on `reference_runtime` (this process's
    engine; kept in `generate`) right before the programs, and a row's ratio is the median of the
    rounds'."""
    rows = []
    for loop in loops:
        run_batch(runtime, LOOPS[loop], max(clients), 4, path)    # warm-up: sandbox, its instance slots, programs
        for n in clients:
            results = []
            for _ in range(rounds):
                generate[n].append(reference(reference_runtime, n, tokens))
                r = run_batch(runtime, LOOPS[loop], n, tokens, path)
                results.append((n * tokens / r["wall"] / generate[n][-1], r))
            ratio, r = sorted(results, key=lambda x: x[0])[len(results) // 2]
            ms = 1e3 / (n * tokens)                                    # seconds of the run -> ms a token
            host = f"{ms * r['host_cpu']:.2f}"                # this process's programs, or the host actors'
            plane = f"{ms * r['plane_cpu']:.2f}" if path == "local" else "–"         # its data plane is here
            cpu = f"{host} | {plane}"
            rows.append(f"| {kind} | {path} | {loop} | {n} | {n * tokens / r['wall']:.1f} | {ratio:.2f} "
                        f"| {histogram(r['steps'])} | {r['busy']:.2f} | {cpu} |")
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
