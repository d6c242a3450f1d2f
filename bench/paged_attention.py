"""CPU decode attention of one layer, side by side: the C++ paged kernel
(pie_actors/gpu/kernels/csrc/paged_decode.cpp) against the torch gather path, and the kernel on pages laid
out in order or scattered over the pool, in KV tensors on 4 KiB or transparent huge pages.

    python bench/paged_attention.py [--batches 1,8,32] [--context 128] [--pool-pages 4096] [--rounds 5]
                                    [--stream-mb 7]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), bf16, 16-token pages. A
step calls one layer after another of 30, each its own KV tensors, and between two layers (untimed)
reads `--stream-mb` of other memory, as the model streams a layer's weights (~7 MB) there: so the
pages come from memory, not from the last level cache, as in the model (--stream-mb 0: pages
warm in the last level cache). The table shows microseconds a layer, median of interleaved rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from report import add_output_options, publish

from pie_actors.gpu.kernels import cpu_kernels
from pie_actors.gpu.kernels.attention import _decode_attention, _gather
from pie_actors.gpu.kernels import hugepages

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 30


def page_tables(batch: int, pages_each: int, pool: int, scattered: bool) -> torch.Tensor:
    if scattered:
        return torch.randperm(pool)[:batch * pages_each].view(batch, pages_each)
    # lanes growing together take pages in turn: lane b's pages are b, b + batch, ...
    return torch.arange(batch * pages_each).view(pages_each, batch).t().contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=128, help="slots each lane attends")
    parser.add_argument("--pool-pages", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stream-mb", type=float, default=7.0,
                        help="memory read between two layers (a layer's weights in the model)")
    add_output_options(parser, "CPU paged decode attention")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_kernels.load(), "the kernel did not build"
    shape, dtype, cpu = (KV_HEADS, args.pool_pages * PAGE, HEAD_DIM), torch.bfloat16, torch.device("cpu")
    zeros = {True: hugepages.zeros, False: torch.zeros}    # torch.zeros: small pages in THP "madvise" mode
    pools = {huge: [(zeros[huge](shape, dtype=dtype, device=cpu), zeros[huge](shape, dtype=dtype, device=cpu))
                    for _ in range(LAYERS)] for huge in (False, True)}
    pages_each = -(-args.context // PAGE)
    batches = [int(b) for b in args.batches.split(",")]

    def kernel(huge: bool, scattered: bool, batch: int):
        pages = page_tables(batch, pages_each, args.pool_pages, scattered)
        lengths = torch.full((batch,), args.context, dtype=torch.int32)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=dtype)
        return lambda i: cpu_kernels.paged_decode_attention(q, *pools[huge][i], pages, lengths, PAGE)

    def gather(huge: bool, scattered: bool, batch: int):
        pages = page_tables(batch, pages_each, args.pool_pages, scattered)
        index = (pages.unsqueeze(-1) * PAGE + torch.arange(PAGE)).flatten(1)
        mask = (torch.arange(index.shape[1]) < args.context)[None, None, None, :].expand(batch, 1, 1, -1)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=dtype)
        def layer(i: int) -> torch.Tensor:
            k, v = pools[huge][i]
            return _decode_attention(q, _gather(k, index), _gather(v, index), mask)
        return layer

    variants = {
        "C++ kernel, pages in turn, huge pages (default)": (kernel, True, False),
        "C++ kernel, pages in turn, 4 KiB pages": (kernel, False, False),
        "C++ kernel, scattered pages, huge pages": (kernel, True, True),
        "C++ kernel, scattered pages, 4 KiB pages": (kernel, False, True),
        "torch gather + matmuls, pages in turn, huge pages": (gather, True, False),
    }
    calls = {(name, b): make(huge, scattered, b) for name, (make, huge, scattered) in variants.items() for b in batches}
    words = int(args.stream_mb * 2**20) // 8
    chunks = hugepages.zeros((words * LAYERS,), dtype=torch.int64, device=cpu).chunk(LAYERS) if words else []

    def step(call) -> float:
        """Seconds in `call` over the 30 layers, `--stream-mb` read before each."""
        spent = 0.0
        for i in range(LAYERS):
            if chunks:
                chunks[i].sum()
            t = time.perf_counter()
            call(i)
            spent += time.perf_counter() - t
        return spent

    times: dict = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, call in calls.items():
            step(call)                                  # warm: the first call after another variant
            times[key].append(step(call) / LAYERS * 1e6)
    default = next(iter(variants))
    med = {key: statistics.median(v) for key, v in times.items()}
    rows = ["| variant | " + " | ".join(f"batch {b}: us a layer (x default)" for b in batches) + " |",
            "|---|" + "---|" * len(batches)]
    for name in variants:
        rows.append(f"| {name} | " + " | ".join(f"{med[name, b]:.0f} ({med[name, b] / med[default, b]:.2f}x)"
                                               for b in batches) + " |")
    note = (f"bf16, {args.context} slots a lane, pool of {args.pool_pages} pages, {args.threads} threads, "
            f"{args.stream_mb:g} MB read between layers, "
            f"median of {args.rounds} interleaved rounds; 1-min load average {os.getloadavg()[0]:.1f} at the end")
    publish(note, "\n".join(rows), args.out, args.title)


if __name__ == "__main__":
    main()
