"""Single-stream bf16 decode, the engine (compiled decode) against llama.cpp F16, interleaved.

    python bench/single_stream.py [--tokens 128] [--rounds 5] [--out bench/RESULTS.md --title "..."]

bench/engine.py runs one system after another; on a shared machine the load drifts between them.
Here each round decodes once with every system, so drift hits all of them alike, and the table gives
medians and the ratio to llama.cpp (the single-stream target: >= 1.0x). Both time decode only:
the n-1 tokens after the first, the prompt's prefill left out. Before timing, each system must give
transformers' float32 greedy tokens on bench/engine.py's check prompt; one that does not is named in
an error and the bench exits with status 1, printing no table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from baselines import llama_cpp_generate, llama_cpp_model
from decode_forms import decode_tps
from engine import CHECK_PROMPT, CHECK_TOKENS, reference_tokens
from gguf_variants import variant
from report import add_output_options, publish

from pie_actors.gpu.engine import Engine

PROMPT = "The capital of France is"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    add_output_options(parser, "single-stream decode, interleaved with llama.cpp")
    args = parser.parse_args()

    engine = Engine.from_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16", compile=True,
                               num_threads=args.threads)
    llm = llama_cpp_model(str(variant("F16")), args.threads)
    prompt = engine.tokenizer.encode(PROMPT)
    n = args.tokens

    def engine_tps() -> float:        # decode only, like llama_tps: from the first token to the last
        return decode_tps(engine, [prompt], n)

    def llama_tps() -> float:
        _, _, decode_s = llama_cpp_generate(llm, prompt, n)
        return (n - 1) / decode_s

    systems = {"engine, compiled decode, bf16": engine_tps, "llama.cpp, F16 GGUF": llama_tps}
    answers = {"engine, compiled decode, bf16": engine.generate([CHECK_PROMPT], CHECK_TOKENS, ignore_eos=True)[0],
               "llama.cpp, F16 GGUF": llama_cpp_generate(llm, CHECK_PROMPT, CHECK_TOKENS)[0]}
    want = list(reference_tokens())
    wrong = [f"error: {name}: greedy tokens {got} != reference {want} (transformers, float32); no speed is printed"
             for name, got in answers.items() if list(got) != want]
    if wrong:
        sys.exit("\n".join(wrong))
    for run in systems.values():
        run()                         # compile / warm up
    speeds: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, run in systems.items():
            speeds[name].append(run())
    reference = statistics.median(speeds["llama.cpp, F16 GGUF"])
    rows = ["| system | median tok/s | ÷ llama.cpp | every round |", "|---|---|---|---|"]
    for name, values in speeds.items():
        median = statistics.median(values)
        rows.append(f"| {name} | {median:.1f} | {median / reference:.2f}x | "
                    f"{', '.join(f'{v:.0f}' for v in values)} |")
    env = (f"{n} new tokens after a {len(prompt)}-token prompt, greedy, {args.threads} threads, "
           f"{args.rounds} interleaved rounds; 1-min load average {os.getloadavg()[0]:.1f} at the end")
    publish(env, "\n".join(rows) + "\n", args.out, args.title)


if __name__ == "__main__":
    main()
