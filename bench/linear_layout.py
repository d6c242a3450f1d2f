"""What storing linear weights column-major (pie_actors/gpu/kernels/column_major.py) is worth on this CPU.

    python bench/linear_layout.py [--rounds 7] [--out bench/RESULTS.md --title "..."]

Two tables, float32, the default model's shapes, rows alternating between the two layouts so that
the machine's drift hits both alike:
- one `F.linear` of each of the model's weight shapes, x @ W^T for M rows, W row-major (as loaded)
  and column-major (W^T contiguous);
- engine steps of two engines in one process, `column_major_weights` off and on: decode batches of
  1-16 lanes over a 300-token context, a short turn's prefill (18 tokens) alone and beside two decode
  lanes, and a long prefill. Each step's tokens are compared between the engines.
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

ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
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
    layer = engine.worker.model.layers[0]
    shapes = {"qkv": layer.self_attn.qkv_proj.weight.shape, "o": layer.self_attn.o_proj.weight.shape,
              "gate/up": layer.mlp.gate_proj.weight.shape, "down": layer.mlp.down_proj.weight.shape}
    rows = ["| weight [out, in] | rows M | row-major µs | column-major µs | row ÷ column |", "|---|---|---|---|---|"]
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k)
        layouts = {"row": w, "column": w.t().contiguous().t()}
        for m in ROWS:
            x = torch.randn(m, k)
            took = {name: [] for name in layouts}
            for _ in range(rounds):
                for lay, weight in layouts.items():
                    took[lay].append(_median_ms(lambda: F.linear(x, weight), 20) * 1e3)
            r, c = statistics.median(took["row"]), statistics.median(took["column"])
            rows.append(f"| {name} [{n}, {k}] | {m} | {r:.0f} | {c:.0f} | {r / c:.2f}x |")
    return "\n".join(rows)


def step_table(engines: dict[bool, Engine], rounds: int) -> str:
    argmax = lambda logits: int(logits[-1].argmax())      # noqa: E731
    seqs = {}
    for on, engine in engines.items():
        seqs[on] = [engine.create_sequence() for _ in range(17)]
        for s in seqs[on]:
            engine.submit(PassRequest([Lane(s, list(range(100, 100 + CONTEXT)))], argmax))
        engine.run_until_idle()
    cases: dict[str, Callable[[list[int]], list[Lane]]] = {
        **{f"decode, {b} lanes": (lambda s, b=b: [Lane(x, [5]) for x in s[:b]]) for b in (1, 2, 4, 8, 16)},
        "prefill 18 tokens": lambda s: [Lane(s[16], list(range(200, 218)))],
        "prefill 18 tokens + 2 decode lanes": lambda s: [Lane(s[0], [5]), Lane(s[1], [6]),
                                                         Lane(s[16], list(range(200, 218)))],
        "prefill 256 tokens": lambda s: [Lane(s[16], list(range(200, 456)))]}
    rows = ["| step | row-major ms | column-major ms | row ÷ column | same tokens |", "|---|---|---|---|---|"]
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
    ap.add_argument("--rounds", type=int, default=7)
    add_output_options(ap, "Linear layers: column-major weights")
    args = ap.parse_args()
    # room for 17 sequences of the context and every step a round appends to them
    engines = {on: Engine.from_model("smollm2-135m-instruct", device="cpu", dtype="float32", num_pages=2048,
                                     compile="off", column_major_weights=on) for on in (False, True)}
    report = "\n\n".join([gemm_table(engines[False], args.rounds), step_table(engines, args.rounds)])
    env = (f"SmolLM2-135M-Instruct, float32, eager engine, {torch.get_num_threads()} threads; decode lanes over a "
           f"{CONTEXT}-token context; medians of {args.rounds} alternating rounds; 1-min load average "
           f"{os.getloadavg()[0]:.1f} at the end")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
