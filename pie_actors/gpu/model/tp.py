"""Tensor parallelism: the collective interface and the sharded layers that use it.

`join_group` gives a rank its collectives: gloo (torch.distributed) on the CPU, NCCL through cupy
on CUDA, both behind `Comm`. Each layer owns its shard of the weight and a
`weight_loader(param, full_tensor, shard_id=None)` that cuts the rank's slice out of a full
checkpoint tensor, so loading is one loop over checkpoint names (see `load_weights` in llama.py). Column-parallel layers split output features; row-parallel
layers split input features and all-reduce their partial sums.
"""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_kernels


class Comm:
    """Collectives across the tensor-parallel group. The single-rank base class is the identity."""

    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 passes `obj`; every rank returns it."""
        return obj

    def close(self) -> None:
        pass


def join_group(rank: int, world_size: int, init_method: str, device: torch.device) -> Comm:
    """This rank's collectives: NCCL through cupy on CUDA (CupyNcclComm), gloo on the CPU."""
    if device.type == "cuda":
        return CupyNcclComm(rank, world_size, init_method, device)
    return TorchDistComm(rank, world_size, init_method)


class TorchDistComm(Comm):
    """torch.distributed over gloo: every collective of CPU ranks, and the batch plans of all ranks."""

    def __init__(self, rank: int, world_size: int, init_method: str):
        self.rank, self.world_size = rank, world_size
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class CupyNcclComm(TorchDistComm):
    """CUDA ranks: tensors through NCCL by cupy (`cupy.cuda.nccl`) on the tensor's current stream;
    batch plans, and the NCCL unique id at set-up, over the gloo group of TorchDistComm."""

    def __init__(self, rank: int, world_size: int, init_method: str, device: torch.device):
        try:
            from cupy.cuda import nccl
        except ImportError as e:
            raise RuntimeError(f"tensor parallelism on CUDA uses cupy's NCCL: pip install cupy-cuda12x "
                               f"(or the build of your CUDA version) ({e})") from None
        super().__init__(rank, world_size, init_method)    # the gloo group
        self._nccl = nccl
        uid = self.broadcast_object(nccl.get_unique_id() if rank == 0 else None)
        torch.cuda.set_device(device)
        self._comm = nccl.NcclCommunicator(world_size, uid, rank)

    def _args(self, x: torch.Tensor) -> tuple[int, int, int]:
        """(count, NCCL dtype, stream) of a call on `x`."""
        name = str(x.dtype).removeprefix("torch.")
        if name not in NCCL_DTYPES:
            raise TypeError(f"no NCCL collective for {x.dtype}; it takes {', '.join(NCCL_DTYPES)}")
        return x.numel(), getattr(self._nccl, NCCL_DTYPES[name]), torch.cuda.current_stream(x.device).cuda_stream

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        count, dtype, stream = self._args(x)
        self._comm.allReduce(x.data_ptr(), x.data_ptr(), count, dtype, self._nccl.NCCL_SUM, stream)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        parts = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        self._comm.allGather(x.data_ptr(), parts.data_ptr(), *self._args(x))
        return torch.cat(parts.unbind(0), dim=dim)

    def close(self) -> None:
        self._comm.destroy()
        super().close()


NCCL_DTYPES = {"float32": "NCCL_FLOAT32", "float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16",
               "int32": "NCCL_INT32", "int64": "NCCL_INT64"}     # torch dtype name -> cupy.cuda.nccl's


def _shard(x: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    size = x.shape[dim] // comm.world_size
    return x.narrow(dim, comm.rank * size, size)


def _check_divisible(n: int, comm: Comm, what: str) -> None:
    if n % comm.world_size:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {comm.world_size}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_kernel: bool) -> torch.Tensor:
    """x W^T + b. With `row_kernel` (the engine's `cpu_linear_kernel`, set by `use_row_kernel`), up to
    `LINEAR_MAX_ROWS` rows run the CPU kernel that reads the weights once (cpu_kernels.py); compiled
    graphs keep F.linear, whose weights inductor packs for its own GEMM."""
    if (row_kernel and x.numel() <= cpu_kernels.LINEAR_MAX_ROWS * x.shape[-1]
            and not torch.compiler.is_compiling()):
        return cpu_kernels.linear_rows(x, weight, bias)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split along output features; each rank returns its slice of y."""

    row_kernel = False          # see `linear`

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm):
        super().__init__()
        _check_divisible(out_features, comm, "out_features")
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out_features // comm.world_size, in_features),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // comm.world_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        param.data.copy_(_shard(loaded, 0, self.comm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.row_kernel)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (q+k+v).

    `sizes` are the full output sizes of the parts; each rank holds its slice of every part, in order.
    """

    def __init__(self, in_features: int, sizes: dict[str, int], bias: bool, comm: Comm):
        for name, n in sizes.items():
            _check_divisible(n, comm, f"{name} size")
        super().__init__(in_features, sum(sizes.values()), bias, comm)
        self.local_sizes = {name: n // comm.world_size for name, n in sizes.items()}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        offset = 0
        for name, n in self.local_sizes.items():
            if name == shard_id:
                param.data.narrow(0, offset, n).copy_(_shard(loaded, 0, self.comm))
                return
            offset += n
        raise KeyError(f"unknown shard {shard_id!r}; parts are {list(self.local_sizes)}")

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(list(self.local_sizes.values()), dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split along input features; partial products are all-reduced."""

    row_kernel = False          # see `linear`

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm):
        super().__init__()
        _check_divisible(in_features, comm, "in_features")
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out_features, in_features // comm.world_size),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        param.data.copy_(loaded if loaded.dim() == 1 else _shard(loaded, 1, self.comm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(linear(x, self.weight, None, self.row_kernel))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank embeds its rows and the results are summed."""

    def __init__(self, vocab_size: int, dim: int, comm: Comm):
        super().__init__()
        _check_divisible(vocab_size, comm, "vocab_size")
        self.comm = comm
        self.vocab_size = vocab_size
        self.shard_size = vocab_size // comm.world_size
        self.start = comm.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        param.data.copy_(_shard(loaded, 0, self.comm))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * inside.unsqueeze(-1)
        return self.comm.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection split by vocabulary; logits are gathered so every rank holds all of them."""

    row_kernel = False          # see `linear`

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.comm.all_gather(linear(hidden, self.weight, None, self.row_kernel), dim=-1)


def use_row_kernel(model: nn.Module) -> None:
    """Switch every linear layer of `model`, the LM head included, to `linear`'s CPU kernel for a few
    rows. The caller checks that the kernel applies (CPU, float32) and builds."""
    for layer in model.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            layer.row_kernel = True
