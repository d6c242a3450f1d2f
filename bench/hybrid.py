"""Decode tokens/s of the engine on a hybrid model (Qwen3.5: gated DeltaNet and gated attention
layers) against transformers `generate` on the same random model and prompts, at batch 1 and 16.

    python bench/hybrid.py [--batches 1 16] [--prompt-len 64] [--new-tokens 64] [--repeats 3] [--out bench/RESULTS.md]

No package registry ships Qwen3.5 weights small enough here, so transformers writes a random one as a
Hugging Face folder (the shape is in the table's line above it) and the engine loads that folder the
way it loads a user's. Both decode greedily, float32 on the CPU, every prompt of a batch together,
the same random prompts; a row whose tokens differ between the two is refused, not timed. Decode
tokens/s is the new tokens after the first, summed over the batch, over the time past the prefill
(a run of one new token, timed alone). Median of --repeats, after a warm-up of each.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from report import add_output_options, publish

# a small Qwen3.5: 3 DeltaNet layers then one attention layer, twice
SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=4096,
             tie_word_embeddings=False)


def write_model(folder: Path) -> torch.nn.Module:
    """A random Qwen3.5 written as a Hugging Face folder; returns transformers' model of it."""
    import transformers
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE)).eval()
    with torch.no_grad():        # logits far apart: float32 rounding never flips a greedy token
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    add_output_options(ap, "Hybrid model (Qwen3.5) decode vs transformers generate")
    args = ap.parse_args()

    from pie_actors.gpu.engine import Engine

    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "random-qwen3_5"
        reference = write_model(folder)
        engine = Engine.from_model(str(folder), device="cpu", dtype="float32", compile="off", num_pages=2048,
                                   progress=False)
        generator = torch.Generator().manual_seed(1)
        for batch in args.batches:
            prompts = torch.randint(0, SHAPE["vocab_size"], (batch, args.prompt_len), generator=generator)
            ids = prompts.tolist()

            def ours(n: int) -> list[list[int]]:
                return engine.generate(ids, n, ignore_eos=True)

            def theirs(n: int) -> list[list[int]]:
                with torch.no_grad():
                    out = reference.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                             pad_token_id=0)
                return out[:, args.prompt_len:].tolist()

            n = args.new_tokens
            if ours(n) != theirs(n):                        # also the warm-up of each
                rows.append((batch, False, {}))
                continue
            speeds = {}
            for name, fn in (("engine.generate", ours), ("transformers generate", theirs)):
                prefill = median_seconds(lambda: fn(1), args.repeats)
                total = median_seconds(lambda: fn(n), args.repeats)
                speeds[name] = batch * (n - 1) / (total - prefill)
            rows.append((batch, True, speeds))
        engine.close()

    lines = ["| batch | engine.generate tok/s | transformers generate tok/s | engine ÷ transformers |",
             "|---|---|---|---|"]
    for batch, same, speeds in rows:
        if not same:
            lines.append(f"| {batch} | refused: tokens differ | refused: tokens differ | — |")
            continue
        ours_tps, theirs_tps = speeds["engine.generate"], speeds["transformers generate"]
        lines.append(f"| {batch} | {ours_tps:.1f} | {theirs_tps:.1f} | {ours_tps / theirs_tps:.2f}× |")
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items() if k != "max_position_embeddings")
    env = (f"random Qwen3.5 ({shape}), float32, CPU, eager engine; prompts of {args.prompt_len} random ids, "
           f"{args.new_tokens} new tokens, greedy, tokens equal in every row shown; median of {args.repeats}; "
           f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, "\n".join(lines), args.out, args.title)


if __name__ == "__main__":
    main()
