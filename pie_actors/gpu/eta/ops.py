"""The eta operations: arity, argument kinds, semantics and the torch implementation of each.

Semantics (the user's reference). "x" is a tensor; "v" a tensor or a number; numbers are Python
literals in the traced program. Binary elementwise ops broadcast like numpy and promote like
torch (an i32 tensor plus 2.5 is f32). Reductions and distributions act on the LAST axis:
reductions drop it, cumulative ops and masks keep it. Distributions compute in f32.

| op | args | result |
|---|---|---|
| add sub mul div | v, v | elementwise; div is true division (ints give f32) |
| neg abs exp log cos | v | elementwise; exp/log/cos of ints give f32 |
| max_elem min_elem | v, v | elementwise max / min (NaN propagates) |
| matmul | x, x | torch.matmul in f32 |
| l2norm | x | sqrt(sum(x²)) over the last axis, f32 |
| eq ne lt le gt ge | v, v | bool |
| and | v, v | logical and (nonzero is true), bool |
| select | cond, v, v | where(cond, a, b) |
| mask_apply | x, mask | where(mask, x, -inf) |
| reshape | x, shape | shape may hold one -1 |
| broadcast | v, shape | x broadcast to shape; a number fills it (float→f32, int→i64, bool→bool) |
| cast | v, dtype | dtype: "f32" "f16" "bf16" "i32" "i64" "u32" "bool" |
| constant | values, dtype="f32" | a number or nested list of numbers |
| iota | n, dtype="i32" | [0, 1, ..., n-1] |
| indptr | | the pass's read-out row offsets per lane, i32 [lanes + 1] (lane i's rows of a stacked [rows, vocab] are indptr[i]:indptr[i+1]) |
| reduce_max reduce_sum | x | torch.amax / torch.sum (sum of ints and bools is i64) |
| reduce_argmax | x | index of the first maximum, i64 |
| cumsum cumprod | x | keep the axis |
| cummass_le | probs, p | bool: in the top-p nucleus (descending order, stable on ties, the mass *before* a token is < p), in vocab order |
| softmax log_softmax | x | f32 |
| entropy | logits | entropy of softmax(logits), f32 (0·log 0 = 0) |
| entropy_from_logprobs | lp | -sum(exp(lp)·lp), f32 |
| top_k | x, k | x with the values below the k-th largest set to -inf (ties at the k-th value are kept) |
| gumbel | shape, seed | Gumbel(0, 1) noise, f32 |
| gumbel_max | logits, seed | argmax(logits + gumbel(shape of logits, seed)), i64 |
| nucleus_sample | logits, p, seed | gumbel_max(mask_apply(logits, cummass_le(softmax(logits), p)), seed) |
| masked_argmax | x, mask | argmax(where(mask, x, lowest value)); 0 when nothing is allowed, i64 |
| gather | x, idx | idx with x's rank: take_along_axis (result has idx's shape); one rank less or a number: one element per row; indices are clamped to the axis |
| gather_row | x, row | x[row] (row clamped) |
| causal_mask | n | bool [n, n], true on and below the diagonal |
| output | lane, name | model output of the lane's read-out rows: [vocab] for one row, [rows, vocab] for several; f32 |
| take | channel | dequeue one value from the channel |
| put | channel, x | enqueue x; produces no value |
| arg | i | argument i of an adapter function f(x, y): 0 = the projection's input rows [rows, in], 1 = its output rows [rows, out] (as traced by fwd.adapter) |

Seeds are integers: a number in the program, or a one-element integer tensor (taken from a
channel, say). Noise is a counter-based hash of (seed, flat element index) - row*vocab + col for
[rows, vocab] - so it is the same on every device and backend, and each row gets its own.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import cpu_kernels

__all__ = ["EtaError", "OpSpec", "OPS", "DTYPES", "MODEL_OUTPUTS", "MAX_ELEMENTS", "is_ref",
           "mix32", "seed_key", "seed_keys", "gumbel_noise", "flat_index", "MIX_MULTIPLIERS", "GOLDEN"]


class EtaError(ValueError):
    """A bad eta program; the message names the op index, the op and the problem."""


DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32,
    "i64": torch.int64, "u32": torch.uint32, "bool": torch.bool,
}
MODEL_OUTPUTS = ("logits",)
# Shapes written in a program are allocated on the device (constants are folded at compile
# time), so a guest must not be able to ask for an arbitrary amount of memory.
MAX_ELEMENTS = 1 << 26


# ---------------------------------------------------------------------------------------------
# argument kinds

def is_ref(a: Any) -> bool:
    """A tensor argument: {"t": index of the op that made it}."""
    return isinstance(a, dict) and a.keys() == {"t"} and _is_int(a["t"])


def _is_int(a: Any) -> bool:
    return isinstance(a, int) and not isinstance(a, bool)


def _is_num(a: Any) -> bool:
    return isinstance(a, (int, float))


def _is_values(a: Any) -> bool:
    return _is_num(a) or (isinstance(a, list) and all(_is_values(v) for v in a))


def _is_shape(a: Any) -> bool:
    return (isinstance(a, list) and all(_is_int(d) and d >= 0 for d in a)
            and math.prod(a) <= MAX_ELEMENTS)


def _is_newshape(a: Any) -> bool:
    return (isinstance(a, list) and all(_is_int(d) and d >= -1 for d in a)
            and sum(d == -1 for d in a) <= 1)


# kind -> (check, what the message says an argument of that kind must be)
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tensor": (is_ref, "a tensor"),
    "value": (lambda a: is_ref(a) or _is_num(a), "a tensor or a number"),
    "integer": (lambda a: is_ref(a) or _is_int(a), "an integer or an integer tensor"),
    "id": (lambda a: _is_int(a) and a >= 0, "a non-negative integer"),
    "k": (lambda a: _is_int(a) and a >= 1, "a positive integer"),
    "count": (lambda a: _is_int(a) and 0 <= a <= MAX_ELEMENTS, f"an integer from 0 to {MAX_ELEMENTS}"),
    "side": (lambda a: _is_int(a) and 0 <= a <= math.isqrt(MAX_ELEMENTS), f"an integer from 0 to {math.isqrt(MAX_ELEMENTS)}"),
    "name": (lambda a: isinstance(a, str), "a string"),
    "dtype": (lambda a: a in DTYPES, "a dtype name (" + ", ".join(DTYPES) + ")"),
    "shape": (_is_shape, f"a list of non-negative integers of at most {MAX_ELEMENTS} elements"),
    "newshape": (_is_newshape, "a list of integers (at most one -1)"),
    "values": (_is_values, "a number or a nested list of numbers"),
}


# ---------------------------------------------------------------------------------------------
# the counter-based RNG, written once for Python ints and int64 tensors alike (the Triton
# backend mirrors it): values stay below 2**32 and the multipliers below 2**31, so no product
# overflows int64.

M32 = 0xFFFFFFFF
MIX_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
GOLDEN = 0x9E3779B9


def mix32(x):
    """A 32-bit integer hash (two multiply-xorshift rounds)."""
    m1, m2 = MIX_MULTIPLIERS
    x = x ^ (x >> 16)
    x = (x * m1) & M32
    x = x ^ (x >> 15)
    x = (x * m2) & M32
    return x ^ (x >> 15)


def seed_key(seed: int | torch.Tensor):
    """The 32-bit stream key of a seed: a Python int, or a 0-d int64 tensor for a tensor seed."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype == torch.bool:
            raise ValueError(f"a seed must be one integer, got a {_describe(seed)} tensor")
        seed = seed.reshape(()).to(torch.int64)
    return seed_keys(seed)


def seed_keys(seeds):
    """The stream keys of int64 seeds, elementwise (a Python int is one seed)."""
    return mix32((seeds & M32) ^ mix32(((seeds >> 32) & M32) ^ GOLDEN))


def gumbel_noise(index: torch.Tensor, key) -> torch.Tensor:
    """Gumbel(0, 1) noise for int64 element indices under a stream key."""
    h = mix32(mix32((index + key) & M32) ^ key)
    u = ((h >> 8) | 1).to(torch.float32) * 2.0 ** -24      # an odd 24-bit integer: u in (0, 1)
    return -torch.log(-torch.log(u))


def flat_index(shape, device) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.int64, device=device).reshape(shape)


# ---------------------------------------------------------------------------------------------
# implementations (scalars only reach them mixed with tensors: all-constant ops are folded)

def _describe(x: torch.Tensor) -> str:
    return f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}"


def _tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _binary(fn):
    """A binary op with torch's semantics when both operands are numbers (folded constants)."""
    def impl(a, b):
        return fn(a if isinstance(b, torch.Tensor) else _tensor(a), b)
    return impl


def _extremum(fn, bound: str):
    """maximum/minimum; a number operand becomes a clamp bound (no per-run scalar tensor)."""
    def impl(a, b):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return fn(a, b)
        t, s = (a, b) if isinstance(a, torch.Tensor) else (b, a)
        return torch.clamp(_tensor(t), **{bound: s})
    return impl


def _and(a, b) -> torch.Tensor:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.logical_and(a, b)
    t, s = (a, b) if isinstance(a, torch.Tensor) else (b, a)
    return _tensor(t).bool() & bool(s)


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Index of the first maximum along `dim` (the first NaN where there is one). On the CPU, rows
    of float32 logits go to the C++ kernel (cpu_kernels.py: ~3x torch.max's speed, 1.2 -> 0.5 ms for
    batch-32 logits here); otherwise torch.max, whose indices follow argmax's rule for ties and NaN
    and run ~3x faster than torch.argmax on the CPU."""
    last = dim in (-1, x.dim() - 1)
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() in (1, 2) and last
            and x.shape[-1] > 0 and cpu_kernels.load()):
        rows = cpu_kernels.argmax_rows(x.reshape(-1, x.shape[-1]))
        return rows[0] if x.dim() == 1 else rows
    return x.max(dim).indices


def _lowest(x: torch.Tensor) -> float | int:
    return -math.inf if x.dtype.is_floating_point else torch.iinfo(x.dtype).min


def _where_mask(x, mask: torch.Tensor, fill):
    return torch.where(mask.bool(), x, fill)


def _broadcast(x, shape: list[int]) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return torch.broadcast_to(x, shape)
    return torch.full(shape, x)


def _constant(values, dtype: str = "f32") -> torch.Tensor:
    return torch.tensor(values, dtype=DTYPES[dtype])


def _iota(n: int, dtype: str = "i32") -> torch.Tensor:
    return torch.arange(n, dtype=DTYPES[dtype])


def _cummass_le(probs: torch.Tensor, p) -> torch.Tensor:
    ordered, order = torch.sort(probs.float(), dim=-1, descending=True, stable=True)
    total = torch.cumsum(ordered, dim=-1)
    before = torch.cat([torch.zeros_like(total[..., :1]), total[..., :-1]], dim=-1)
    keep = before < p
    return torch.empty_like(keep).scatter_(-1, order, keep)


def _entropy_terms(lp: torch.Tensor) -> torch.Tensor:
    p = torch.exp(lp)
    return -torch.where(p > 0, p * lp, 0.0).sum(-1)


def _top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    x = x if x.dtype.is_floating_point else x.float()
    kth = torch.topk(x, min(k, x.shape[-1]), dim=-1).values[..., -1:]
    return torch.where(x >= kth, x, -math.inf)


def _gumbel(shape: list[int], seed) -> torch.Tensor:
    device = seed.device if isinstance(seed, torch.Tensor) else None
    return gumbel_noise(flat_index(shape, device), seed_key(seed))


def _gumbel_max(logits: torch.Tensor, seed) -> torch.Tensor:
    x = logits.float()
    return argmax(x + gumbel_noise(flat_index(x.shape, x.device), seed_key(seed)))


def _nucleus_sample(logits: torch.Tensor, p, seed) -> torch.Tensor:
    x = logits.float()
    return _gumbel_max(torch.where(_cummass_le(torch.softmax(x, -1), p), x, -math.inf), seed)


def _masked_argmax(x: torch.Tensor, mask) -> torch.Tensor:
    return argmax(_where_mask(x, mask, _lowest(x)))


def _clamped(index, n: int):
    """Indices are clamped: an out-of-range index must not fault the device (CUDA asserts)."""
    if isinstance(index, torch.Tensor):
        if index.dtype.is_floating_point or index.dtype == torch.bool:
            raise ValueError(f"indices must be integers, got a {_describe(index)} tensor")
        return index.to(torch.int64).clamp(0, n - 1)
    return min(max(index, 0), n - 1)


def _gather(x: torch.Tensor, index) -> torch.Tensor:
    index = _clamped(index, x.shape[-1])
    if not isinstance(index, torch.Tensor):
        return x[..., index]
    if index.dim() == x.dim() - 1:
        return torch.take_along_dim(x, index.unsqueeze(-1), dim=-1).squeeze(-1)
    return torch.take_along_dim(x, index, dim=-1)


def _gather_row(x: torch.Tensor, row) -> torch.Tensor:
    row = _clamped(row, x.shape[0])
    if isinstance(row, torch.Tensor):
        if row.numel() != 1:
            raise ValueError(f"a row must be one integer, got a {_describe(row)} tensor")
        return x.index_select(0, row.reshape(1)).squeeze(0)
    return x[row]


def _output(env, lane: int, name: str) -> torch.Tensor:
    return env.output(lane, name).float()     # programs see f32 whatever the model runs in


def _take(env, channel: int) -> torch.Tensor:
    return env.take(channel)


def _put(env, channel: int, value: torch.Tensor) -> None:
    env.put(channel, value)


def _indptr(env) -> torch.Tensor:
    return env.indptr()


def _argument(env, index: int) -> torch.Tensor:
    return env.arg(index)


# ---------------------------------------------------------------------------------------------
# the table

@dataclass(frozen=True)
class OpSpec:
    name: str
    kinds: tuple[str, ...]     # argument kinds (see KINDS)
    required: int              # the first `required` arguments must be given; the rest have defaults
    impl: Callable[..., Any]   # the torch implementation; env ops take the Env first
    env: bool = False          # reads or changes the pass (output, take, put, indptr): never folded

    def check(self, args: list) -> str | None:
        """The problem with `args` (arity or kind), or None."""
        if not self.required <= len(args) <= len(self.kinds):
            want = (str(self.required) if self.required == len(self.kinds)
                    else f"{self.required} to {len(self.kinds)}")
            return f"takes {want} arguments, got {len(args)}"
        for i, (a, kind) in enumerate(zip(args, self.kinds)):
            ok, what = KINDS[kind]
            if not ok(a):
                return f"argument {i} must be {what}, got {a!r}"
        return None


def _unary(fn):
    return lambda x: fn(_tensor(x))


def _reduce(fn):
    return lambda x: fn(x, dim=-1)


_V, _T = "value", "tensor"
OPS: dict[str, OpSpec] = {spec.name: spec for spec in [
    OpSpec("add", (_V, _V), 2, _binary(operator.add)),
    OpSpec("sub", (_V, _V), 2, _binary(operator.sub)),
    OpSpec("mul", (_V, _V), 2, _binary(operator.mul)),
    OpSpec("div", (_V, _V), 2, _binary(operator.truediv)),
    OpSpec("neg", (_V,), 1, _unary(torch.neg)),
    OpSpec("abs", (_V,), 1, _unary(torch.abs)),
    OpSpec("exp", (_V,), 1, _unary(torch.exp)),
    OpSpec("log", (_V,), 1, _unary(torch.log)),
    OpSpec("cos", (_V,), 1, _unary(torch.cos)),
    OpSpec("max_elem", (_V, _V), 2, _extremum(torch.maximum, "min")),
    OpSpec("min_elem", (_V, _V), 2, _extremum(torch.minimum, "max")),
    OpSpec("matmul", (_T, _T), 2, lambda a, b: torch.matmul(a.float(), b.float())),
    OpSpec("l2norm", (_T,), 1, lambda x: torch.linalg.vector_norm(x.float(), dim=-1)),
    OpSpec("eq", (_V, _V), 2, _binary(operator.eq)),
    OpSpec("ne", (_V, _V), 2, _binary(operator.ne)),
    OpSpec("lt", (_V, _V), 2, _binary(operator.lt)),
    OpSpec("le", (_V, _V), 2, _binary(operator.le)),
    OpSpec("gt", (_V, _V), 2, _binary(operator.gt)),
    OpSpec("ge", (_V, _V), 2, _binary(operator.ge)),
    OpSpec("and", (_V, _V), 2, _and),
    OpSpec("select", (_T, _V, _V), 3, lambda c, a, b: _where_mask(a, c, b)),
    OpSpec("mask_apply", (_T, _T), 2, lambda x, m: _where_mask(x, m, -math.inf)),
    OpSpec("reshape", (_T, "newshape"), 2, torch.reshape),
    OpSpec("broadcast", (_V, "shape"), 2, _broadcast),
    OpSpec("cast", (_V, "dtype"), 2, lambda x, d: _tensor(x).to(DTYPES[d])),
    OpSpec("constant", ("values", "dtype"), 1, _constant),
    OpSpec("iota", ("count", "dtype"), 1, _iota),
    OpSpec("indptr", (), 0, _indptr, env=True),
    OpSpec("reduce_max", (_T,), 1, _reduce(torch.amax)),
    OpSpec("reduce_sum", (_T,), 1, _reduce(torch.sum)),
    OpSpec("reduce_argmax", (_T,), 1, _reduce(argmax)),
    OpSpec("cumsum", (_T,), 1, _reduce(torch.cumsum)),
    OpSpec("cumprod", (_T,), 1, _reduce(torch.cumprod)),
    OpSpec("cummass_le", (_T, _V), 2, _cummass_le),
    OpSpec("softmax", (_T,), 1, lambda x: torch.softmax(x.float(), -1)),
    OpSpec("log_softmax", (_T,), 1, lambda x: torch.log_softmax(x.float(), -1)),
    OpSpec("entropy", (_T,), 1, lambda x: _entropy_terms(torch.log_softmax(x.float(), -1))),
    OpSpec("entropy_from_logprobs", (_T,), 1, lambda lp: _entropy_terms(lp.float())),
    OpSpec("top_k", (_T, "k"), 2, _top_k),
    OpSpec("gumbel", ("shape", "integer"), 2, _gumbel),
    OpSpec("gumbel_max", (_T, "integer"), 2, _gumbel_max),
    OpSpec("nucleus_sample", (_T, _V, "integer"), 3, _nucleus_sample),
    OpSpec("masked_argmax", (_T, _T), 2, _masked_argmax),
    OpSpec("gather", (_T, "integer"), 2, _gather),
    OpSpec("gather_row", (_T, "integer"), 2, _gather_row),
    OpSpec("causal_mask", ("side",), 1, lambda n: torch.ones(n, n, dtype=torch.bool).tril()),
    OpSpec("output", ("id", "name"), 2, _output, env=True),
    OpSpec("take", ("id",), 1, _take, env=True),
    OpSpec("put", ("id", _T), 2, _put, env=True),
    OpSpec("arg", ("id",), 1, _argument, env=True),
]}
