"""Tokens/s of the quickstart inferlet (WASM sandbox -> socket -> engine) vs the engine called
directly on the same prompt and the same number of passes, in one process, as a ratio.

    python bench/decode.py [--question "..."] [--dtype bfloat16] [--repeats 3] [--out bench/RESULTS.md]

The inferlet decodes until its stop token; the engine then runs exactly as many greedy passes
(generate with that many new tokens), so both do the same model work. Median of --repeats, after
a warm-up run of each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from report import publish

from pie_actors.gpu.engine.data_plane import serve_model
from pie_actors.inferlet.chat_ops import ChatTokens
from pie_actors.inferlet.run import run_inferlet

QUICKSTART = (Path(__file__).resolve().parent.parent / "examples/quickstart/main.py").read_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--question", default="Write a short story about a dragon who learns to bake bread.")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="append the table, command line and date to this markdown file")
    ap.add_argument("--title", default="Quickstart inferlet vs engine.generate")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    server, address = serve_model(dtype=args.dtype)
    engine = server.engine
    try:
        chat = ChatTokens(engine.tokenizer)
        prompt = (chat.system("You are a concise assistant.") + chat.user(args.question)
                  + chat.cue_without_thinking())

        def inferlet() -> int:
            """Run the quickstart; returns the passes it made."""
            before = sum(n * count for n, count in engine.batch_sizes.items())
            run_inferlet(QUICKSTART, {"question": args.question}, address)
            return sum(n * count for n, count in engine.batch_sizes.items()) - before

        passes = inferlet()                                  # warm-up; fixes the pass count
        engine.generate([prompt], passes, ignore_eos=True)   # warm-up

        def timed(fn) -> float:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        t_inferlet = timed(inferlet)
        t_engine = timed(lambda: engine.generate([prompt], passes, ignore_eos=True))
    finally:
        server.close()
        engine.close()

    rows = [("engine.generate (in process)", passes / t_engine), ("quickstart inferlet via run_inferlet", passes / t_inferlet)]
    report = "\n".join(["| path | passes (prompt + tokens) | tokens/s |", "|---|---|---|"] +
                       [f"| {name} | {passes} | {tps:.1f} |" for name, tps in rows])
    report += f"\n\ninferlet ÷ engine: {rows[1][1] / rows[0][1]:.2f}×\n"
    env = (f"{args.dtype}, default model, eager engine; median of {args.repeats}; "
           f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
