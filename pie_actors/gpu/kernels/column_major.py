"""Linear weights stored column-major on the CPU, float32: the same [out, in] parameters, their memory
transposed.

`F.linear(x, W)` computes x @ W^T. With W row-major, as checkpoints store it, the CPU's BLAS runs a
"transposed B" GEMM, and for a few rows (decode batches of 2-16 lanes, a short turn's prefill) that
kernel is 1.5-4x slower here than the plain one it runs when W^T is contiguous, i.e. W column-major
(bench/RESULTS.md, "Linear layers: column-major weights"). One row (batch-1 decode) and many rows
(long prefills) run at the same speed either way. bf16 GEMMs go through oneDNN, which packs the
weight itself: there the layout changes nothing measurable, so they are left as loaded.
Embedding tables stay row-major: a lookup reads whole rows, and a tied LM head shares its table.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model.tp import ColumnParallelLinear, RowParallelLinear


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def apply(model: nn.Module) -> int:
    """Store the weight of every linear layer (tensor-parallel or plain) column-major, in place of its
    row-major copy; the number of weights moved. Embedding tables and the LM head (which may share
    one) are not linear layers here."""
    moved = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, nn.Linear)):
            module.weight.data = module.weight.data.t().contiguous().t()
            moved += 1
    return moved
