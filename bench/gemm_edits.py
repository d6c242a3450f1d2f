"""What inductor's AMX micro-GEMM edits (pie_actors/gpu/kernels/amx_gemm.py) are worth to a compiled decode step.

    python bench/gemm_edits.py [--keep 1] [--batch 32] [--rounds 6] [--out bench/RESULTS.md --title "..."]

Two engines in one process: A compiles its decode graph with only the first `--keep` of
`amx_gemm._EDITS`, B with all of them; then rounds alternate between the two (decode tokens/s by
subtraction, as engine.py measures the engine), so the machine's drift hits both alike.
"""
from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm; see baselines.py

from baselines import by_subtraction
from report import add_output_options, publish

from pie_actors.gpu.kernels import amx_gemm
from pie_actors.gpu.engine import Engine

PROMPT_LEN, NEW_TOKENS = 32, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=int, default=1, help="edits engine A compiles with (the first K)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    add_output_options(ap, "AMX micro-GEMM edits")
    args = ap.parse_args()
    every = amx_gemm._EDITS
    runs = {}
    for name, edits in (("A", every[:args.keep]), ("B", every)):
        amx_gemm._EDITS = edits            # read when the bucket compiles, in the first generate
        engine = Engine.from_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16", compile=True)
        engine.generate([[1, 2, 3]] * args.batch, max_new_tokens=2, ignore_eos=True)
        runs[name] = by_subtraction(lambda p, n, e=engine: e.generate(p, max_new_tokens=n, ignore_eos=True))
    amx_gemm._EDITS = every
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            _, decode = run(args.batch, PROMPT_LEN, NEW_TOKENS)
            speeds[name].append(args.batch * (NEW_TOKENS - 1) / decode)
    labels = {"A": f"A: first {args.keep} of {len(every)} edits", "B": f"B: all {len(every)} edits"}
    med = {name: statistics.median(s) for name, s in speeds.items()}
    rows = [f"| {labels[n]} | {med[n]:.1f} | {med[n] / med['A']:.3f}x | {', '.join(f'{s:.0f}' for s in speeds[n])} |"
            for n in runs]
    report = "\n".join(["| engine | median decode tok/s | ÷ A | every round |", "|---|---|---|---|", *rows])
    env = (f"bf16, batch {args.batch}, {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens, "
           f"{args.rounds} alternating rounds; 1-min load average {os.getloadavg()[0]:.1f} at the end")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
