"""What the CPU kernel for a few rows' linear layer (csrc/linear_rows.cpp) is worth on this CPU.

    python bench/linear_rows.py [--rounds 5] [--out bench/RESULTS.md --title "..."]

Two tables, float32, the default model's shapes, the contenders alternating so that the machine's
drift hits them alike:
- x @ W^T for M rows of each of the model's weight shapes, the LM head's included: the BLAS on W
  row-major (as loaded), the BLAS on W column-major (W^T contiguous: its plain, not transposed, GEMM),
  and the kernel on W row-major. Each is timed over copies of the weight that together outgrow the
  caches, as a model step reads its weights from memory;
- engine steps of two engines in one process, `cpu_linear_kernel` off and on: decode batches of
  1-32 lanes over a 300-token context, a short turn's prefill (18 tokens) alone and beside two decode
  lanes, and longer prefills. Each step's tokens are compared between the engines.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm; see baselines.py

import torch
import torch.nn.functional as F
from report import add_output_options, publish

from pie_actors.gpu.engine import Engine, Lane, PassRequest
from pie_actors.gpu.kernels import cpu_kernels

ROWS = (1, 2, 3, 4, 8, 16, 32, 48, 56, 64)
STREAM_BYTES = 256 << 20        # the weight copies one timing reads, well past any cache
CONTEXT = 300


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gemm_table(engine: Engine, rounds: int) -> str:
    model = engine.worker.model
    layer = model.layers[0]
    shapes = {"qkv": layer.self_attn.qkv_proj.weight.shape, "o": layer.self_attn.o_proj.weight.shape,
              "gate/up": layer.mlp.gate_proj.weight.shape, "down": layer.mlp.down_proj.weight.shape,
              "LM head": model.lm_head.weight.shape}
    rows = ["| weight [out, in] | rows M | BLAS, row-major µs | BLAS, column-major µs | kernel µs "
            "| row-major ÷ kernel | column-major ÷ kernel |", "|---|---|---|---|---|---|---|"]
    for name, (n, k) in shapes.items():
        row = [torch.randn(n, k) for _ in range(max(2, STREAM_BYTES // (n * k * 4)))]
        column = [w.t().contiguous().t() for w in row]
        for m in ROWS:
            x = torch.randn(m, k)
            torch.testing.assert_close(cpu_kernels.linear_rows(x, row[0]), F.linear(x, row[0]), rtol=1e-4, atol=1e-4)
            runs = {"row": lambda: [F.linear(x, w) for w in row], "column": lambda: [F.linear(x, w) for w in column],
                    "kernel": lambda: [cpu_kernels.linear_rows(x, w) for w in row]}
            took = {how: [] for how in runs}
            for _ in range(rounds):
                for how, run in runs.items():
                    took[how].append(_median_ms(run, 3) * 1e3 / len(row))
            r, c, kern = (statistics.median(took[how]) for how in runs)
            rows.append(f"| {name} [{n}, {k}] | {m} | {r:.0f} | {c:.0f} | {kern:.0f} | {r / kern:.2f}x | {c / kern:.2f}x |")
    return "\n".join(rows)


def step_table(engines: dict[bool, Engine], rounds: int) -> str:
    argmax = lambda logits: int(logits[-1].argmax())      # noqa: E731
    seqs = {}
    for on, engine in engines.items():
        seqs[on] = [engine.create_sequence() for _ in range(33)]
        for s in seqs[on]:
            engine.submit(PassRequest([Lane(s, list(range(100, 100 + CONTEXT)))], argmax))
        engine.run_until_idle()
    cases: dict[str, Callable[[list[int]], list[Lane]]] = {
        **{f"decode, {b} lanes": (lambda s, b=b: [Lane(x, [5]) for x in s[:b]]) for b in (1, 2, 3, 4, 8, 16, 32)},
        "prefill 18 tokens": lambda s: [Lane(s[32], list(range(200, 218)))],
        "prefill 18 tokens + 2 decode lanes": lambda s: [Lane(s[0], [5]), Lane(s[1], [6]),
                                                         Lane(s[32], list(range(200, 218)))],
        "prefill 40 tokens": lambda s: [Lane(s[32], list(range(200, 240)))],
        "prefill 256 tokens": lambda s: [Lane(s[32], list(range(200, 456)))]}
    rows = ["| step | BLAS ms | kernel ms | BLAS ÷ kernel | same tokens |", "|---|---|---|---|---|"]
    for name, lanes in cases.items():
        took, tokens = {on: [] for on in engines}, {}
        for _ in range(rounds):
            for on, engine in engines.items():
                futures = [engine.submit(PassRequest([lane], argmax)) for lane in lanes(seqs[on])]
                start = time.perf_counter()
                engine.run_until_idle()
                took[on].append((time.perf_counter() - start) * 1e3)
                tokens[on] = [f.result() for f in futures]
        r, c = statistics.median(took[False]), statistics.median(took[True])
        rows.append(f"| {name} | {r:.1f} | {c:.1f} | {r / c:.2f}x | {tokens[False] == tokens[True]} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    add_output_options(ap, "Linear layers: a few rows")
    args = ap.parse_args()
    # room for 33 sequences of the context and every step a round appends to them
    engines = {on: Engine.from_model("smollm2-135m-instruct", device="cpu", dtype="float32", num_pages=2048,
                                     compile="off", cpu_linear_kernel=on) for on in (False, True)}
    report = "\n\n".join([gemm_table(engines[False], args.rounds), step_table(engines, args.rounds)])
    env = (f"SmolLM2-135M-Instruct, float32, eager engine, {torch.get_num_threads()} threads; decode lanes over a "
           f"{CONTEXT}-token context; medians of {args.rounds} alternating rounds; 1-min load average "
           f"{os.getloadavg()[0]:.1f} at the end")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
