"""What the eta surface buys, measured on the real default model in one process, as ratios:

(a) run-ahead decoding (examples/run_ahead: the decode pass repeats on the engine, the host only
    reads tokens) vs one pass per token (examples/completion_max: the host waits for each token
    before submitting the next pass), same prompt, same tokens, with the requests each run's host
    sent the engine;
(b) ten branches forked from one long prompt (examples/prefix_sharing) vs ten independent
    requests for the same prompt (the same program with one branch each), run at once and one
    after another: wall time, and prompt tokens the model computed (counted at the worker).

    python bench/eta.py [--dtype bfloat16] [--tokens 64] [--prompt-tokens 500] [--repeats 3]
                        [--out bench/RESULTS.md]

Each request is an inferlet launched with `Runtime.local`: in the WASM sandbox, talking to the
engine in this process over its socket. Every timed run of (b) gets a prompt of its own (a
different first line), so the engine's prefix cache holds nothing from an earlier run; within a
run the independent requests may find the pages another of them already froze, which is what the
prompt-token counts show.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from inferlets import run_alone
from report import add_output_options, publish

from pie_actors import Program, Runtime

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_AHEAD, PER_TOKEN, PREFIX_SHARING = (Program.load(EXAMPLES / name)
                                        for name in ("run_ahead", "completion_max", "prefix_sharing"))
DECODE_PROMPT = "Here is a list of the first hundred numbers: 1, 2, 3, 4, 5,"
BRANCHES = 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", help="model dtype (default: the config's choice)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded in (a)")
    ap.add_argument("--prompt-tokens", type=int, default=500, help="about how long the prompt of (b) is")
    ap.add_argument("--branch-tokens", type=int, default=16, help="tokens each branch of (b) decodes")
    ap.add_argument("--repeats", type=int, default=3)
    add_output_options(ap, "run_ahead vs one pass per token; ten forks vs ten requests")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    runtime = Runtime.local(dtype=args.dtype, compile=False)
    engine = runtime.engine
    computed = [0]                                    # rows the model ran
    execute = engine.worker.execute

    def counting(plan):
        computed[0] += len(plan.input_ids)
        return execute(plan)
    engine.worker.execute = counting

    def timed(fn):
        """Median wall time of `fn()` over the repeats (after a warm-up), and its results."""
        fn()
        times, results = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            results.append(fn())
            times.append(time.perf_counter() - t0)
        return statistics.median(times), results

    try:
        def decode(program: Program):
            """Run a decode program: its output and the requests its host sent the engine."""
            out, done = run_alone(runtime, program, {"prompt": DECODE_PROMPT, "max_tokens": args.tokens})
            return out, done["requests"]

        t_ahead, [*_, (ahead, ahead_requests)] = timed(lambda: decode(RUN_AHEAD))
        t_token, [*_, (per_token, token_requests)] = timed(lambda: decode(PER_TOKEN))
        assert len(ahead["tokens"]) == args.tokens and ahead["text"] == per_token["text"], (ahead, per_token)

        runs = iter(range(10**6))
        line = ("The harbour log, entry {i}: the tide, the wind, the ships that came and went, the nets "
                "mended on the quay and the weather for the night. ")
        tokens_per_line = len(engine.tokenizer.encode(line.format(i=0)))
        lines = max(1, args.prompt_tokens // tokens_per_line)

        def prompt() -> str:
            first = f"Run {next(runs):05d}. "        # fixed width: every prompt has the same length
            return first + "".join(line.format(i=i) for i in range(lines)) + "Write the next entry:"
        prompt_len = len(engine.tokenizer.encode(prompt()))

        decoded = BRANCHES * (args.branch_tokens - 1)     # rows each case decodes after its prompt(s)

        def fork() -> int:
            """Prompt tokens the model computed."""
            before = computed[0]
            runtime.launch(PREFIX_SHARING, {"prompt": prompt(), "branches": BRANCHES,
                                            "max_tokens": args.branch_tokens}).result()
            return computed[0] - before - decoded

        def requests(at_once: bool):
            def one(text: str, seed: int):
                return runtime.launch(PREFIX_SHARING, {"prompt": text, "branches": 1, "seed": seed,
                                                       "max_tokens": args.branch_tokens})

            def run() -> int:
                text, before = prompt(), computed[0]
                if at_once:
                    processes = [one(text, seed) for seed in range(BRANCHES)]
                    for process in processes:
                        process.result()
                else:
                    for seed in range(BRANCHES):
                        one(text, seed).result()
                return computed[0] - before - decoded
            return run

        cases = [("10 branches forked from one prompt (one inferlet)", timed(fork)),
                 ("10 independent requests, at once", timed(requests(at_once=True))),
                 ("10 independent requests, one after another", timed(requests(at_once=False)))]
    finally:
        runtime.close()

    decode_rows = [("run_ahead (examples/run_ahead)", args.tokens / t_ahead, ahead_requests),
                   ("one pass per token (examples/completion_max)", args.tokens / t_token, token_requests)]
    report = "\n".join(["| decode | tokens | tokens/s | requests to the engine |", "|---|---|---|---|"] +
                       [f"| {name} | {args.tokens} | {tps:.1f} | {n} |" for name, tps, n in decode_rows])
    report += f"\n\nrun_ahead ÷ per-token: {decode_rows[0][1] / decode_rows[1][1]:.2f}× tokens/s\n\n"

    header = (f"| {BRANCHES} completions of a {prompt_len}-token prompt, {args.branch_tokens} tokens each "
              "| wall s | prompt tokens computed, each run |")
    report += "\n".join([header, "|---|---|---|"] +
                        [f"| {name} | {t:.2f} | {', '.join(map(str, counts))} |" for name, (t, counts) in cases])
    t_fork, fork_counts = cases[0][1]
    report += "\n\n" + "\n".join(
        f"{name.removeprefix('10 independent requests, ')} ÷ fork: {t / t_fork:.2f}× wall time, "
        f"{statistics.median(counts) / statistics.median(fork_counts):.2f}× prompt tokens computed (medians)"
        for name, (t, counts) in cases[1:]) + "\n"
    env = (f"{str(engine.worker.dtype).removeprefix('torch.')}, default model, "
           f"eager engine, in process, inferlets in the WASM sandbox; median of {args.repeats} after a warm-up; "
           f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
