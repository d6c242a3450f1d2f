"""The Triton backend: an eta program fused into ONE kernel, one program instance per read-out row.

Every value of a fused program is, for each read-out row, either a vector over the vocab axis
(BLOCK = next power of two >= vocab, masked) or a scalar, and is either the same for all rows
("uniform": constants, taken seeds, [vocab] masks) or the row's own (anything computed from the
logits). Fused ops: output, take, put, add sub mul div neg abs exp log cos max_elem min_elem,
eq ne lt le gt ge and select mask_apply cast reshape broadcast, reduce_max reduce_sum
reduce_argmax l2norm, softmax log_softmax entropy entropy_from_logprobs, gumbel gumbel_max
masked_argmax; ops that depend on no pass (constant, iota, causal_mask, ...) are folded at
compile time and read by the kernel like a taken value.

The kernel is specialised on the shapes and dtypes of the pass's inputs (model outputs and
taken values): for each new signature the program runs once on torch's meta device, which
checks shapes exactly as the torch backend does and gives every value's shape and dtype; the
kernel casts each value to that dtype, so both backends compute the same things. When the
values do not fit the per-row scheme (reads of several shapes, a value that is neither a
per-row vector nor a scalar, rows == vocab) the pass runs the torch interpreter instead.

Takes happen before the kernel and puts after it, so a program may not take from a channel it
has put into (the torch backend runs those). Kernel sources are written to
$PIE_HOME/cache/eta/ (Triton's JIT reads a function's source from its file) and loaded once
per process; triton is imported only here, when a kernel is first built.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from ...config import pie_home
from .ops import GOLDEN, MIX_MULTIPLIERS, seed_key
from .program import Env, Node, Parsed, Program, call

__all__ = ["TritonProgram", "unsupported", "FUSED"]

FUSED = frozenset({
    "output", "take", "put", "add", "sub", "mul", "div", "neg", "abs", "exp", "log", "cos",
    "max_elem", "min_elem", "eq", "ne", "lt", "le", "gt", "ge", "and", "select", "mask_apply",
    "cast", "reshape", "broadcast", "reduce_max", "reduce_sum", "reduce_argmax", "l2norm",
    "softmax", "log_softmax", "entropy", "entropy_from_logprobs", "gumbel", "gumbel_max",
    "masked_argmax",
})


def unsupported(parsed: Parsed, consts: dict[int, torch.Tensor]) -> str | None:
    """Why the Triton backend cannot fuse this program (naming the op), or None."""
    put_into: set[int] = set()
    for node in parsed.nodes:
        name = node.spec.name
        if node.index in consts:
            continue
        if name not in FUSED:
            return f"op {node.index} ({name}): not supported by the Triton backend"
        if name == "put":
            put_into.add(node.args[0])
        if name == "take" and node.args[0] in put_into:
            return (f"op {node.index} (take): takes from channel {node.args[0]} after putting into it "
                    "(the Triton backend takes before its kernel runs and puts after)")
    if not any(node.spec.name == "output" for node in parsed.nodes):
        return "the program reads no model output (the Triton backend runs one instance per read-out row)"
    return None


# ---------------------------------------------------------------------------------------------
# kinds: (row, vec) - the row's own value or the same for all rows; a vocab vector or a scalar

Kind = tuple[bool, bool]
UNIFORM, ROW, UNIFORM_VEC, ROW_VEC = (False, False), (True, False), (False, True), (True, True)


def _join(*kinds: Kind) -> Kind:
    return any(k[0] for k in kinds), any(k[1] for k in kinds)


class _Unfused(Exception):
    """The pass's shapes do not fit the per-row kernel (the torch interpreter runs it)."""


@dataclass(frozen=True)
class _Rows:
    """The row structure of a pass: the shape every model output read has."""
    shape: tuple[int, ...]       # (vocab,) or (rows, vocab)

    @property
    def vocab(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1

    def kind_of(self, shape) -> Kind:
        """The kind of a value of `shape` that does not come from the logits."""
        shape = tuple(shape)
        if math.prod(shape) == 1:
            return UNIFORM
        if shape == (self.vocab,):
            return UNIFORM_VEC
        if len(self.shape) == 2 and shape == self.shape:
            return ROW_VEC
        if len(self.shape) == 2 and shape == (self.rows,):
            return ROW
        raise _Unfused(f"a value of shape {list(shape)}")

    def fits(self, kind: Kind, shape) -> bool:
        """Whether torch's shape for a value agrees with its kind (so per-row code is exact)."""
        shape = tuple(shape)
        row, vec = kind
        if self.rows == 1:               # one row: its values and uniform ones coincide
            return shape in ((self.vocab,), (1, self.vocab)) if vec else math.prod(shape) == 1
        if vec:
            return shape == (self.shape if row else (self.vocab,))
        return shape == (self.rows,) if row else math.prod(shape) == 1


# ---------------------------------------------------------------------------------------------
# code generation

_TL = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
       torch.float64: "tl.float64", torch.int32: "tl.int32", torch.int64: "tl.int64",
       torch.uint32: "tl.uint32", torch.bool: "tl.int1"}

_HELPERS = f'''import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * {MIX_MULTIPLIERS[0]:#x}) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * {MIX_MULTIPLIERS[1]:#x}) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _seed_key(s):
    s = s.to(tl.int64)
    return _mix32((s & 0xFFFFFFFF) ^ _mix32(((s >> 32) & 0xFFFFFFFF) ^ {GOLDEN:#x}))


@triton.jit
def _gumbel(index, key):
    h = _mix32(_mix32((index + key) & 0xFFFFFFFF) ^ key)
    u = ((h >> 8) | 1).to(tl.float32) * 5.960464477539063e-08
    return -tl.log(-tl.log(u))
'''

_ARITH = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_UNARY_MATH = {"exp": "tl.exp", "log": "tl.log", "cos": "tl.cos"}


@dataclass(frozen=True)
class _Var:
    name: str
    kind: Kind
    dtype: torch.dtype
    meta: torch.Tensor


def _literal(x: Any, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "True" if x else "False"
    if dtype.is_floating_point:
        x = float(x)
        return repr(x) if math.isfinite(x) else f'float("{x}")'
    return str(int(x))


def _lowest(dtype: torch.dtype) -> str:
    return 'float("-inf")' if dtype.is_floating_point else str(torch.iinfo(dtype).min)


class _Kernel:
    """Generates the source of one kernel for one pass signature."""

    def __init__(self, program: TritonProgram, values: list, rows: _Rows) -> None:
        self.program, self.values, self.rows = program, values, rows
        self.vars: dict[int, _Var] = {}
        self.body: list[str] = []
        # parameters: the fetched inputs (op order), the folded constants read, the results
        self.fetch_params: list[str] = []
        self.const_params: list[str] = []
        self.store_params: list[str] = []
        self.consts: list[int] = []      # folded ops the kernel reads, in parameter order

    # -- operands --------------------------------------------------------------------------
    def arg(self, node: Node, pos: int):
        a = node.args[pos]
        return self.var(a["t"]) if isinstance(a, dict) else a

    def var(self, i: int) -> _Var:
        if i not in self.vars:           # a folded constant: read like a taken value
            self.consts.append(i)
            self.const_params.append(f"x{i}")
            self.external(i, f"x{i}")
        return self.vars[i]

    def cast(self, a, dtype: torch.dtype) -> str:
        if not isinstance(a, _Var):
            return _literal(a, dtype)
        if a.dtype == dtype:
            return a.name
        if dtype == torch.bool:
            return f"({a.name} != 0)"
        return f"{a.name}.to({_TL[dtype]})"

    def let(self, name: str, expr: str) -> str:
        self.body.append(f"{name} = {expr}")
        return name

    # -- values ----------------------------------------------------------------------------
    def define(self, i: int, expr: str, kind: Kind) -> None:
        meta = self.values[i]
        if meta.dtype not in _TL:
            raise _Unfused(f"dtype {meta.dtype}")
        if not self.rows.fits(kind, meta.shape):
            raise _Unfused(f"op {i} of shape {list(meta.shape)}")
        self.vars[i] = _Var(self.let(f"v{i}", expr), kind, meta.dtype, meta)

    def external(self, i: int, param: str) -> None:
        """A tensor the kernel loads whole: a taken value or a folded constant."""
        kind = self.rows.kind_of(self.values[i].shape)
        at = {UNIFORM: "", ROW: " + row", UNIFORM_VEC: " + col", ROW_VEC: " + row64 * V + col"}[kind]
        masked = ", mask=inb, other=0" if kind[1] else ""
        self.define(i, f"tl.load({param}{at}{masked})", kind)

    def store(self, k: int, v: _Var) -> None:
        param = f"o{k}"
        self.store_params.append(param)
        if v.kind == ROW_VEC:
            self.body.append(f"tl.store({param} + row64 * V + col, {v.name}, mask=inb)")
        elif v.kind == ROW:
            self.body.append(f"tl.store({param} + row, {v.name})")
        else:                            # uniform: the first row's instance writes it
            at, mask = (" + col", ", mask=inb") if v.kind[1] else ("", "")
            self.body += ["if row == 0:", f"    tl.store({param}{at}, {v.name}{mask})"]

    def index(self, kind: Kind) -> str:
        """Flat element indices (the noise counter) of a value of `kind`."""
        return {UNIFORM: "0", ROW: "row64", UNIFORM_VEC: "col.to(tl.int64)",
                ROW_VEC: "row64 * V + col"}[kind]

    def key(self, seed) -> str:
        return str(seed_key(seed)) if not isinstance(seed, _Var) else f"_seed_key({seed.name})"

    def vector(self, node: Node, bools: bool = False) -> _Var:
        v = self.arg(node, 0)
        if not v.kind[1] or (v.dtype == torch.bool and not bools):
            raise _Unfused(f"op {node.index} ({node.spec.name}) of a scalar or bool value")
        return v

    def f32(self, i: int, v: _Var) -> str:
        return self.let(f"t{i}", self.cast(v, torch.float32))

    def softmax_parts(self, i: int, x: str) -> tuple[str, str, str]:
        """x - max, exp(x - max) (0 outside the vocab) and its sum, as torch computes softmax."""
        m = self.let(f"m{i}", f'tl.max(tl.where(inb, {x}, float("-inf")), axis=0)')
        e = self.let(f"e{i}", f"tl.where(inb, tl.exp({x} - {m}), 0.0)")
        return f"({x} - {m})", e, self.let(f"s{i}", f"tl.sum({e}, axis=0)")

    def log_softmax(self, i: int, x: str) -> str:
        shifted, _, total = self.softmax_parts(i, x)
        return f"{shifted} - tl.log({total})"

    def entropy(self, i: int, lp: str) -> str:
        p = self.let(f"p{i}", f"tl.exp({lp})")
        return f"-tl.sum(tl.where(inb & ({p} > 0), {p} * {lp}, 0.0), axis=0)"

    # -- ops -------------------------------------------------------------------------------
    def op(self, node: Node) -> None:
        i, name = node.index, node.spec.name
        rd = self.values[i].dtype if self.values[i] is not None else None
        operands = [self.arg(node, pos) for pos, _ in node.refs]
        kind = _join(*(v.kind for v in operands if isinstance(v, _Var)))
        a = self.arg(node, 0) if node.args else None
        if name == "output":
            self.fetch_params += [f"in{i}", f"in{i}_stride"]
            self.define(i, f"tl.load(in{i} + row64 * in{i}_stride + col, mask=inb, other=0.0).to(tl.float32)", ROW_VEC)
        elif name == "take":
            self.fetch_params.append(f"x{i}")
            self.external(i, f"x{i}")
        elif name == "put":
            pass                         # its value is stored after the outputs (see source)
        elif name in ("reshape", "cast"):
            self.define(i, self.cast(a, rd), a.kind)
        elif name in _ARITH:
            if rd == torch.bool:
                raise _Unfused("arithmetic on bools")
            self.define(i, f"{self.cast(a, rd)} {_ARITH[name]} {self.cast(self.arg(node, 1), rd)}", kind)
        elif name in _COMPARE:
            b = self.arg(node, 1)
            common = torch.result_type(*(v.meta if isinstance(v, _Var) else v for v in (a, b)))
            self.define(i, f"{self.cast(a, common)} {_COMPARE[name]} {self.cast(b, common)}", kind)
        elif name == "neg":
            self.define(i, f"-{self.cast(a, rd)}", kind)
        elif name == "abs":
            self.define(i, f"tl.abs({self.cast(a, rd)})", kind)
        elif name in _UNARY_MATH:
            wide = torch.float64 if rd == torch.float64 else torch.float32
            self.define(i, f"({_UNARY_MATH[name]}({self.cast(a, wide)})).to({_TL[rd]})", kind)
        elif name in ("max_elem", "min_elem"):
            fn = "tl.maximum" if name == "max_elem" else "tl.minimum"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if rd.is_floating_point else ""
            self.define(i, f"{fn}({self.cast(a, rd)}, {self.cast(self.arg(node, 1), rd)}{nan})", kind)
        elif name == "and":
            self.define(i, f"{self.cast(a, torch.bool)} & {self.cast(self.arg(node, 1), torch.bool)}", kind)
        elif name == "select":
            b, c = self.arg(node, 1), self.arg(node, 2)
            self.define(i, f"tl.where({self.cast(a, torch.bool)}, {self.cast(b, rd)}, {self.cast(c, rd)})", kind)
        elif name == "mask_apply":
            m = self.cast(self.arg(node, 1), torch.bool)
            self.define(i, f'tl.where({m}, {self.cast(a, rd)}, float("-inf"))', kind)
        elif name == "broadcast":
            kind = _join(a.kind, self.rows.kind_of(node.args[1]))
            x = self.cast(a, rd)
            self.define(i, f"tl.where(inb, {x}, {x})" if kind[1] and not a.kind[1] else x, kind)
        elif name == "reduce_max":
            x = self.vector(node)
            self.define(i, f"tl.max(tl.where(inb, {x.name}, {_lowest(x.dtype)}), axis=0)", (x.kind[0], False))
        elif name == "reduce_sum":
            x = self.vector(node, bools=True)
            acc = torch.float32 if rd in (torch.float16, torch.bfloat16) else rd
            total = f"tl.sum(tl.where(inb, {self.cast(x, acc)}, 0), axis=0)"
            self.define(i, total if acc == rd else f"({total}).to({_TL[rd]})", (x.kind[0], False))
        elif name == "reduce_argmax":
            x = self.vector(node)
            self.define(i, f"tl.argmax(tl.where(inb, {x.name}, {_lowest(x.dtype)}), axis=0).to(tl.int64)",
                        (x.kind[0], False))
        elif name == "l2norm":
            x = self.vector(node)
            t = self.f32(i, x)
            self.define(i, f"tl.sqrt(tl.sum(tl.where(inb, {t} * {t}, 0.0), axis=0))", (x.kind[0], False))
        elif name == "softmax":
            x = self.vector(node)
            _, e, total = self.softmax_parts(i, self.f32(i, x))
            self.define(i, f"{e} / {total}", x.kind)
        elif name == "log_softmax":
            x = self.vector(node)
            self.define(i, self.log_softmax(i, self.f32(i, x)), x.kind)
        elif name in ("entropy", "entropy_from_logprobs"):
            x = self.vector(node)
            t = self.f32(i, x)
            lp = self.let(f"lp{i}", self.log_softmax(i, t)) if name == "entropy" else t
            self.define(i, self.entropy(i, lp), (x.kind[0], False))
        elif name == "gumbel":
            kind = self.rows.kind_of(node.args[0])
            self.define(i, f"_gumbel({self.index(kind)}, {self.key(self.arg(node, 1))})", kind)
        elif name == "gumbel_max":
            x = self.vector(node)
            noisy = f"{self.f32(i, x)} + _gumbel({self.index(x.kind)}, {self.key(self.arg(node, 1))})"
            self.define(i, f'tl.argmax(tl.where(inb, {noisy}, float("-inf")), axis=0).to(tl.int64)',
                        (x.kind[0], False))
        elif name == "masked_argmax":
            m = self.cast(self.arg(node, 1), torch.bool)
            if not kind[1] or a.dtype == torch.bool:
                raise _Unfused("masked_argmax of a scalar or bool value")
            self.define(i, f"tl.argmax(tl.where(inb & {m}, {a.name}, {_lowest(a.dtype)}), axis=0).to(tl.int64)",
                        (kind[0], False))
        else:                            # unsupported() refuses these programs
            raise AssertionError(f"op {name} is not fused")

    def source(self) -> str:
        p = self.program
        for node in p.nodes:
            if node.index not in p.consts:
                self.op(node)
        for k, ref in enumerate(p.stored):
            self.store(k, self.var(ref))
        params = ", ".join(self.fetch_params + self.const_params + self.store_params)
        lines = ["@triton.jit", f"def eta_kernel({params}, V, BLOCK: tl.constexpr):",
                 "    row = tl.program_id(0)", "    row64 = row.to(tl.int64)",
                 "    col = tl.arange(0, BLOCK)", "    inb = col < V"]
        return _HELPERS + "\n\n" + "\n".join(lines + ["    " + line for line in self.body]) + "\n"


# ---------------------------------------------------------------------------------------------
# kernels: source files loaded once per process

_kernels: dict[str, Any] = {}


def _load(source: str):
    """The `eta_kernel` of a generated source (Triton's JIT reads source from a real file)."""
    digest = hashlib.blake2b(source.encode(), digest_size=16).hexdigest()
    kernel = _kernels.get(digest)
    if kernel is None:
        folder = pie_home() / "cache" / "eta"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"eta_{digest}.py"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source)
            os.replace(tmp, path)        # atomic: processes sharing the cache see whole files
        spec = importlib.util.spec_from_file_location(f"pie_eta_{digest}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kernel = _kernels[digest] = module.eta_kernel
    return kernel


@dataclass(frozen=True)
class _Plan:
    kernel: Any
    reads: frozenset[int]                       # positions among the fetched inputs read with a row stride
    consts: tuple[torch.Tensor, ...]
    stores: tuple[tuple[torch.Size, torch.dtype], ...]   # outputs, then puts
    rows: int
    vocab: int
    block: int
    num_warps: int


class _Replay:
    """An Env handing out inputs fetched earlier, in op order (outputs and takes)."""

    def __init__(self, fetched: list[torch.Tensor], env: Env | None) -> None:
        self._next = iter(fetched)
        self._env = env

    def output(self, lane: int, name: str) -> torch.Tensor:
        return next(self._next)

    def take(self, channel: int) -> torch.Tensor:
        return next(self._next)

    def put(self, channel: int, value: torch.Tensor) -> None:
        if self._env is not None:
            self._env.put(channel, value)


class TritonProgram(Program):
    """A program run as one fused Triton kernel per pass (see the module docstring)."""

    backend = "triton"

    def __init__(self, parsed: Parsed, consts: dict[int, torch.Tensor], device: torch.device) -> None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the Triton backend runs on CUDA devices (or under TRITON_INTERPRET=1), not {device}")
        super().__init__(parsed, consts, device)
        self.fetches = [n for n in parsed.nodes if n.spec.name in ("output", "take")]
        self.puts = [n for n in parsed.nodes if n.spec.name == "put"]
        self.stored = list(self.outputs) + [n.refs[0][1] for n in self.puts]    # what the kernel writes
        self._meta_consts = {i: c.to("meta") for i, c in consts.items()}
        self._plans: dict[tuple, _Plan | None] = {}
        self.fallbacks = 0               # passes run by the torch interpreter (shapes not fused)

    def _plan(self, fetched: list[torch.Tensor]) -> _Plan | None:
        meta = [t.to("meta") for t in fetched]
        values = self.evaluate(_Replay(meta, None), self._meta_consts)     # EtaError on bad shapes
        shapes = {tuple(t.shape) for n, t in zip(self.fetches, fetched) if n.spec.name == "output"}
        if len(shapes) != 1:
            return None
        rows = _Rows(shapes.pop())
        if len(rows.shape) not in (1, 2) or rows.vocab == 0 or (len(rows.shape) == 2 and 1 < rows.rows == rows.vocab):
            return None
        gen = _Kernel(self, values, rows)
        try:
            source = gen.source()
        except _Unfused:
            return None
        stores = tuple((values[r].shape, values[r].dtype) for r in self.stored)
        block = 1 << (rows.vocab - 1).bit_length()            # next power of two >= vocab
        return _Plan(_load(source), frozenset(k for k, n in enumerate(self.fetches) if n.spec.name == "output"),
                     tuple(self.consts[i].contiguous() for i in gen.consts), stores, rows.rows, rows.vocab,
                     block, 4 if block <= 2048 else 8 if block <= 8192 else 16)

    def run(self, env: Env) -> list[torch.Tensor]:
        fetched = [call(node, [], env) for node in self.fetches]
        signature = tuple((t.shape, t.dtype) for t in fetched)
        if signature not in self._plans:
            self._plans[signature] = self._plan(fetched)
        plan = self._plans[signature]
        if plan is None:
            self.fallbacks += 1
            values = self.evaluate(_Replay(fetched, env), self.consts)
            return [values[o] for o in self.outputs]
        args: list = []
        for k, t in enumerate(fetched):
            t = t.to(self.device)
            if k in plan.reads:
                t = t if t.stride(-1) == 1 else t.contiguous()
                args += [t, t.stride(0) if t.dim() == 2 else 0]
            else:
                args.append(t.contiguous())
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in plan.stores]
        plan.kernel[(plan.rows,)](*args, *plan.consts, *buffers, plan.vocab, BLOCK=plan.block,
                                  num_warps=plan.num_warps)
        for node, value in zip(self.puts, buffers[len(self.outputs):]):
            call(node, {node.refs[0][1]: value}, env)
        return buffers[:len(self.outputs)]
