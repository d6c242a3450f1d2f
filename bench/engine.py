"""Benchmark pie_actors' Engine against transformers, a plain torch loop and llama.cpp on the same weights.

    python bench/engine.py [--systems engine,transformers,torch,llamacpp] [--dtype bfloat16,float32]
                           [--tokens 64] [--quick] [--device cpu] [--out bench/RESULTS.md --title "..."]

Prints a markdown table (decode tokens/s at batch 1, 8, 32; prefill tokens/s of a 512-token prompt),
then the engine's speed divided by each other system's. A system that cannot be imported shows
"unavailable: <reason>" in its row. The rows of one dtype are measured together, round by round (each
round runs every system once), so the machine's drift over the minutes of a run hits them alike.

Before a dtype's rows are timed, each greedily decodes CHECK_PROMPT at each of its batch sizes: a row
whose first CHECK_TOKENS tokens differ from transformers' float32 ones is named in an error, and the
bench exits with status 1 and prints no table (a fast but wrong system gets no speed row).
`--device cuda` puts the engine rows on the GPU; the other systems run on the CPU.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import platform
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable

os.environ.setdefault("TQDM_DISABLE", "1")  # before torch imports tqdm; see baselines.py

import torch

from baselines import (THREADS, Run, Speed, by_subtraction, hf_generate, hf_model, llama_cpp_generate,
                       llama_cpp_model, llama_cpp_run, measure, torch_generate, torch_llama, torch_run,
                       transformers_run)
from gguf_variants import default_gguf, variant
from report import add_output_options, publish

SYSTEMS = ("engine", "engine-compiled", "transformers", "torch", "llamacpp")
BATCHES = (1, 8, 32)
DECODE_PROMPT_LEN = 32
PREFILL_PROMPT_LEN = 512
SINGLE_STREAM = {"llamacpp"}     # systems measured at batch 1 only
# llama.cpp has no bf16 matmul path worth comparing on CPU; F16 is its 16-bit storage type
LLAMA_CPP_TYPE = {"bfloat16": "F16", "float32": "F32"}
# "1, 2, 3, 4,": each of its first 8 greedy tokens (" 5, 6, 7") leads the runner-up by more than 3
# in float32, past twice what bf16 rounding moves a logit (0.8 at most, tests/test_shipped_config.py),
# so every correct system gives them in either dtype. A chat question is no such check: "What is the capital
# of France?" opens its answer on a near tie (0.08 apart), which a rounding difference may turn.
CHECK_PROMPT = [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28]
CHECK_TOKENS = 8
# (prompts, new tokens) -> each prompt's greedy tokens: what a row's system answers
Tokens = Callable[[list[list[int]], int], list[list[int]]]

@dataclass
class Row:
    system: str
    weights: str
    decode: dict[int, float] = field(default_factory=dict)  # batch -> tokens/s
    prefill: float = math.nan
    note: str = ""  # "unavailable: ..." / "failed: ..." replaces the numbers


@cache
def pie_engine(device: str, dtype: str, compile: bool) -> Any:
    from pie_actors.gpu.engine import Engine
    # no batch above the largest bucket of BATCHES runs, so no larger one is compiled
    return Engine.from_model("smollm2-135m-instruct", device=device, dtype=dtype, compile=compile,
                             compile_max_batch=max(BATCHES))


def engine_run(device: str, dtype: str, compile: bool) -> tuple[Run, Tokens]:
    engine = pie_engine(device, dtype, compile)  # import/construct here so a missing engine marks only its row
    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        return engine.generate(prompts, max_new_tokens=n, ignore_eos=True)
    return by_subtraction(generate), generate


_child_run: Run | None = None             # the Run a ChildRun's process serves


def _child_start(make: Callable[..., Run], args: tuple) -> None:
    global _child_run
    _child_run = make(*args)


def _child_call(b: int, length: int, n: int) -> tuple[float, float]:
    return _child_run(b, length, n)


def _llama_cpp_tokens(gguf_path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """In the ChildRun's process: the tokens of the model its run holds (llama_cpp_model is cached)."""
    return [llama_cpp_generate(llama_cpp_model(gguf_path, THREADS), p, n)[0] for p in prompts]


class ChildRun:
    """`make(*args)`'s Run, served by a process of its own, so that a crash fails one row, not the
    run: llama.cpp's Q4_1 kernels die of a general protection fault in libggml-cpu on some hosts
    (llama-cpp-python 0.3.36 built here; F16 and F32 run)."""

    def __init__(self, make: Callable[..., Run], *args: Any):
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_child_start, initargs=(make, args))

    def __call__(self, b: int, length: int, n: int) -> tuple[float, float]:
        return self.call(_child_call, b, length, n)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in the child process."""
        try:
            return self.pool.submit(fn, *args).result()
        except BrokenProcessPool:
            raise RuntimeError("the llama.cpp process crashed") from None


def make_run(system: str, dtype: str, device: str) -> tuple[str, Run, Tokens]:
    """(weights label, run, tokens) for one table row; dtype "Q4_1" is for llamacpp only (the shipped file)."""
    gguf = default_gguf()  # Q4_1; transformers and the torch loop dequantize it to `dtype`
    if system in ("engine", "engine-compiled"):
        return dtype, *engine_run(device, dtype, compile=system == "engine-compiled")
    if system == "transformers":
        model = hf_model(str(gguf), dtype)
        return dtype, transformers_run(gguf, dtype), lambda p, n: hf_generate(model, p, n).tolist()
    if system == "torch":
        loop = torch_llama(str(gguf), dtype)
        return dtype, torch_run(gguf, dtype), lambda p, n: torch_generate(loop, p, n)[0].tolist()
    if system == "llamacpp":
        import llama_cpp as _  # noqa: F401  fail fast (unavailable) before writing a GGUF variant
        kind = dtype if dtype == "Q4_1" else LLAMA_CPP_TYPE[dtype]
        path = str(variant(kind))
        child = ChildRun(llama_cpp_run, path, THREADS)
        return f"GGUF {kind}", child, lambda p, n: child.call(_llama_cpp_tokens, path, p, n)
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


@cache
def reference_tokens() -> tuple[int, ...]:
    """transformers' float32 greedy tokens of CHECK_PROMPT, the answer every row must give."""
    return tuple(hf_generate(hf_model(str(default_gguf()), "float32"), [CHECK_PROMPT], CHECK_TOKENS)[0].tolist())


def wrong_tokens(row: Row, tokens: Tokens, want: tuple[int, ...]) -> str | None:
    """Why the row's system does not answer CHECK_PROMPT with `want` at each of its batch sizes (every
    lane of a batch the same prompt, so a wrong batched path shows), or None when it does."""
    for b in (1,) if row.system in SINGLE_STREAM else BATCHES:
        for got in tokens([CHECK_PROMPT] * b, CHECK_TOKENS):
            if tuple(got) != want:
                return f"{row.system} {row.weights} at batch {b}: greedy tokens {list(got)} != reference {list(want)}"
    return None


def bench_rows(specs: list[tuple[str, str]], new_tokens: int, repeats: int, device: str) -> list[Row]:
    """One row per (system, dtype), every measurement interleaved round by round among the rows.
    Exits with status 1, before any timing, when a row's tokens differ from the reference's."""
    rows = [Row(system, dtype) for system, dtype in specs]
    runs: dict[int, Run] = {}
    wrong = []
    for i, row in enumerate(rows):
        try:
            row.weights, runs[i], tokens = make_run(row.system, row.weights, device)
            wrong.append(wrong_tokens(row, tokens, reference_tokens()))
        except ImportError as e:
            row.note = f"unavailable: {e}"
        except Exception as e:  # keep the other rows of a long run; the traceback goes to stderr
            traceback.print_exc()
            row.note = f"failed: {type(e).__name__}: {e}"
            runs.pop(i, None)
    if any(wrong):
        sys.exit("\n".join(f"error: {why}; no speed is printed" for why in wrong if why))

    def measured(batch: int, prompt_len: int, n: int, which: list[int]) -> dict[int, Speed]:
        """`measure` of these rows' runs; a row whose run fails gets its note and leaves `runs`."""
        speeds = {}
        for i, speed in measure({i: runs[i] for i in which}, batch, prompt_len, n, repeats).items():
            if isinstance(speed, Exception):
                print("".join(traceback.format_exception(speed)), file=sys.stderr)
                rows[i].note = f"failed: {type(speed).__name__}: {speed}"
                del runs[i]
            else:
                speeds[i] = speed
        return speeds

    for b in BATCHES:
        which = [i for i in runs if b == 1 or rows[i].system not in SINGLE_STREAM]
        for i, speed in measured(b, DECODE_PROMPT_LEN, new_tokens, which).items():
            rows[i].decode[b] = speed.decode
            print(f"  {rows[i].system} {rows[i].weights} batch {b}: {speed.decode:.1f} tok/s", file=sys.stderr)
    for i, speed in measured(1, PREFILL_PROMPT_LEN, 1, list(runs)).items():
        rows[i].prefill = speed.prefill
    for run in runs.values():
        if isinstance(run, ChildRun):
            run.pool.shutdown()
    return rows


def fmt(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.1f}"


def table(rows: list[Row]) -> str:
    head = ["system", "weights", *(f"decode B={b}" for b in BATCHES), f"prefill {PREFILL_PROMPT_LEN}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.note, *[""] * len(BATCHES)] if r.note else \
            [*(fmt(r.decode.get(b)) for b in BATCHES), fmt(r.prefill)]
        lines.append("| " + " | ".join([r.system, r.weights, *cells]) + " |")
    return "\n".join(lines)


def ratios(rows: list[Row]) -> str:
    """Engine tokens/s divided by each other system's (>1: the engine is faster), against the engine
    row of the same dtype (compiled when it ran); llama.cpp F16 and Q4_1 rows compare with bfloat16."""
    engines = {r.weights: r for r in rows if r.system == "engine" and not r.note}
    engines.update({r.weights: r for r in rows if r.system == "engine-compiled" and not r.note})
    if not engines:
        return "No engine numbers: ratios skipped."
    as_dtype = {"GGUF F16": "bfloat16", "GGUF Q4_1": "bfloat16", "GGUF F32": "float32"}
    head = ["engine ÷ (same dtype)", "weights", *(f"decode B={b}" for b in BATCHES), f"prefill {PREFILL_PROMPT_LEN}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        e = engines.get(as_dtype.get(r.weights, r.weights))
        if r is e or r.note or e is None:
            continue
        cells = [e.decode.get(b, math.nan) / r.decode.get(b, math.nan) for b in BATCHES]
        lines.append("| " + " | ".join([r.system, r.weights, *(fmt(c) + "×" if not math.isnan(c) else "–"
                                                                    for c in cells),
                                          fmt(e.prefill / r.prefill) + "×"]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--dtype", default="bfloat16,float32", help="comma list of bfloat16, float32")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per sequence in decode runs")
    ap.add_argument("--quick", action="store_true", help="16 tokens, 1 repeat: a smoke run, noisy numbers")
    ap.add_argument("--device", default="cpu", help="the engine rows' device: cpu or cuda")
    add_output_options(ap, "Engine vs baselines, all systems, both dtypes")
    args = ap.parse_args()
    new_tokens, repeats = (16, 1) if args.quick else (args.tokens, 3)
    systems = args.systems.split(",")
    dtypes = args.dtype.split(",")

    load_before = os.getloadavg()[0]  # other processes on 2 cores skew every number: record them
    rows = []
    for dtype in dtypes:                  # the rows of one dtype are measured together
        specs = [(s, dtype) for s in systems]
        if "llamacpp" in systems and dtype == dtypes[0]:   # the shipped quantized file: llama.cpp's best case
            specs.append(("llamacpp", "Q4_1"))
        rows += bench_rows(specs, new_tokens, repeats, args.device)

    llama_version = getattr(sys.modules.get("llama_cpp"), "__version__", "n/a")
    env = (f"{platform.processor() or platform.machine()}, {THREADS} threads, torch {torch.__version__}, "
           f"llama-cpp-python {llama_version}; SmolLM2-135M-Instruct; {new_tokens} new tokens, "
           f"decode prompt {DECODE_PROMPT_LEN} tokens, median of {repeats} rounds interleaved across a dtype's rows; "
           f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    report = f"{table(rows)}\n\n{ratios(rows)}\n"
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
