"""Compiled decode variants side by side: the GEMMs by inductor's C++ template (autotuned
against oneDNN) or by oneDNN alone, decode attention by the C++ paged kernel, as fused multiply-sums
or as batched matmuls, and the MLP's gate and up projections as two GEMMs or merged into one.

    python bench/decode_forms.py [--batches 1,8,32] [--tokens 64] [--rounds 3] [--variants 0,6]
                                 [--out bench/RESULTS.md --title "..."]

Each variant is an engine of its own (compiled graphs hold their frozen weights). Every round decodes
once with every variant at every batch size, so load drift hits them alike; tokens/s are decode only
(from each sequence's first token to the batch's last). Compiling takes most of the run: a minute or
more per variant and batch bucket on 2 cores (every bucket up to the largest batch).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import types

import torch
import torch.nn.functional as F
from report import add_output_options, publish

from pie_actors.gpu.kernels.compiled_decode import CompiledDecode
from pie_actors.gpu.engine import Engine

PROMPT = "The capital of France is"
PAGES = 1024                 # the KV pool; the worker's page past it is the scratch page
VARIANTS = {
    "C++ GEMM, attention fused at batch 1, C++ kernel above (default)": {},
    "oneDNN GEMM, attention as default": {"gemm_autotune": False},
    "C++ GEMM, C++ attention kernel at batch 1 too": {"fused_attention_max_batch": 0},
    "C++ GEMM, attention scores fused above batch 1, P·V matmul": {"batch_form": "fused_scores"},
    "C++ GEMM, attention as matmuls": {"batch_form": "matmul", "fused_attention_max_batch": 0},
    "C++ GEMM, gate and up merged in one GEMM": {"merged_gate_up": True},
}


def _merged_mlp_forward(mlp, x: torch.Tensor, adapt=None) -> torch.Tensor:
    gate, up = F.linear(x, mlp.gate_up).chunk(2, dim=-1)
    return mlp.down_proj(F.silu(gate) * up)


def merge_gate_up(engine: Engine) -> None:
    """The MLPs as they were before 2026-11-30: one GEMM for gate and up, its output split."""
    for layer in engine.worker.model.layers:
        mlp = layer.mlp
        mlp.gate_up = torch.nn.Parameter(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                         requires_grad=False)
        del mlp.gate_proj, mlp.up_proj
        mlp.forward = types.MethodType(_merged_mlp_forward, mlp)


def variant_engine(threads: int, max_batch: int, options: dict) -> tuple[Engine, float]:
    """An engine whose decode runs the variant's graphs, compiled now (a scratch folder each: no
    variant loads another's), and the seconds its compile took."""
    engine = Engine.from_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16", compile="off",
                               num_threads=threads, num_pages=PAGES)
    if options.pop("merged_gate_up", False):
        merge_gate_up(engine)
    w = engine.worker
    options = {"batch_form": "kernel" if w.decode_form == "kernel" else "fused_scores", **options}
    w.compiled = CompiledDecode(w.model, w.kv_caches, w.page_size, PAGES, None, max_batch=max_batch, **options)
    t = time.perf_counter()
    w.compiled.warm_up(progress=False)
    return engine, time.perf_counter() - t


def decode_tps(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    arrivals: list[float] = []
    engine.generate(prompts, tokens, ignore_eos=True, on_token=lambda _, __: arrivals.append(time.perf_counter()))
    first_step = arrivals[len(prompts) - 1]            # every sequence has its first token
    return len(prompts) * (tokens - 1) / (arrivals[-1] - first_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", help="comma list of variant numbers (0 = the default) to run; all if unset")
    add_output_options(parser, "compiled decode forms")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    chosen = [int(i) for i in args.variants.split(",")] if args.variants else range(len(VARIANTS))
    built = {name: variant_engine(args.threads, max(batches), dict(options))
             for i, (name, options) in enumerate(VARIANTS.items()) if i in chosen}
    engines = {name: engine for name, (engine, _) in built.items()}
    compile_s = {name: seconds for name, (_, seconds) in built.items()}
    prompt = next(iter(engines.values())).tokenizer.encode(PROMPT)
    prompts = {b: [prompt + [i] for i in range(b)] for b in batches}
    speeds = {(name, b): [] for name in engines for b in batches}
    for _ in range(args.rounds):
        for b in batches:
            for name, engine in engines.items():
                speeds[name, b].append(decode_tps(engine, prompts[b], args.tokens))

    default = next(iter(engines))
    medians = {key: statistics.median(values) for key, values in speeds.items()}
    rows = ["| variant | " + " | ".join(f"batch {b} tok/s (x default)" for b in batches) + " | compile s |",
            "|---|" + "---|" * (len(batches) + 1)]
    for name in engines:
        cells = [f"{medians[name, b]:.1f} ({medians[name, b] / medians[default, b]:.2f}x)" for b in batches]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {compile_s[name]:.0f} |")
    env = (f"bf16 default model, {args.tokens} tokens a sequence, decode only, {args.threads} threads, "
           f"median of {args.rounds} interleaved rounds; compile s: every bucket up to the largest batch; "
           f"1-min load average {os.getloadavg()[0]:.1f} at the end")
    publish(env, "\n".join(rows) + "\n", args.out, args.title)


if __name__ == "__main__":
    main()
