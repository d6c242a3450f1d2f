"""Tokens/s of the quickstart inferlet (WASM sandbox -> socket -> engine) vs the engine called
directly on the same prompt and the same number of passes, in one process, as a ratio.

    python bench/decode.py [--question "..."] [--dtype bfloat16] [--repeats 3] [--out bench/RESULTS.md]

The inferlet is launched with `Runtime.local` (sandbox, data plane and engine in this process) and
decodes until its stop token; the engine then runs exactly as many greedy passes (generate with that
many new tokens), so both do the same model work. Median of --repeats, after a warm-up run of each.
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
from pie_actors.inferlet.chat_ops import ChatTokens

QUICKSTART = Program.load(Path(__file__).resolve().parent.parent / "examples/quickstart")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--question", default="Write a short story about a dragon who learns to bake bread.")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    add_output_options(ap, "Quickstart inferlet vs engine.generate")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    with Runtime.local(dtype=args.dtype, compile=False) as runtime:
        engine = runtime.engine
        chat = ChatTokens(engine.tokenizer)
        prompt = (chat.system("You are a concise assistant.") + chat.user(args.question)
                  + chat.cue_without_thinking())
        question = {"question": args.question}

        _, done = run_alone(runtime, QUICKSTART, question)  # warm-up; fixes the pass count
        passes = done["passes"]
        engine.generate([prompt], passes, ignore_eos=True)   # warm-up

        def timed(fn) -> float:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        t_inferlet = timed(lambda: runtime.launch(QUICKSTART, question).result())
        t_engine = timed(lambda: engine.generate([prompt], passes, ignore_eos=True))

    rows = [("engine.generate (in process)", passes / t_engine),
            ("quickstart inferlet via Runtime.local", passes / t_inferlet)]
    report = "\n".join(["| path | passes (prompt + tokens) | tokens/s |", "|---|---|---|"] +
                       [f"| {name} | {passes} | {tps:.1f} |" for name, tps in rows])
    report += f"\n\ninferlet ÷ engine: {rows[1][1] / rows[0][1]:.2f}×\n"
    env = (f"{args.dtype}, default model, eager engine; median of {args.repeats}; "
           f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
