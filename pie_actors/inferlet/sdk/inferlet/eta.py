"""Forward passes, working sets, pipelines and epilogues (the `eta` device-program API).

An inferlet builds a `ForwardPass` (input tokens, the working sets its lanes extend, the
rows read out, an epilogue), submits it to a `Pipeline` without blocking, and awaits the
epilogue's result.

Epilogues are *traced*: `fwd.epilogue(f)` calls `f()` once with placeholder tensors, and
every eta operation it applies is recorded into a small IR,
``{"ops": [[op, args], ...], "outputs": [ref, ...]}``, where a tensor argument is
``{"t": index of the op that made it}``. The host compiles each distinct IR once
(`pie_actors.inferlet.runtime.ir_to_epilogue`) and refuses, with a clear message, operations
it cannot run yet. Python control flow runs at trace time; use `select` to branch on values.
"""
from __future__ import annotations

import itertools
import json

from . import _host

__all__ = ["ForwardPass", "Pipeline", "StateGeometry", "WorkingSet", "Tensor", "intrinsics",
           "trace"]

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode


# ---------------------------------------------------------------------------------------------
# working sets

class WorkingSet:
    """One sequence's state inside the model (KV cache, recurrent state). The host side is
    made on first use, so creating one costs nothing until a pass references it."""

    def __init__(self) -> None:
        self._handle: int | None = None

    def _h(self) -> int:
        if self._handle is None:
            self._handle = _host.call("ws.create")
        return self._handle

    def folded(self) -> int:
        """Number of tokens in the frozen prefix."""
        return _host.call("ws.state", self._h())["folded"]

    def cached_tokens(self) -> int:
        """Number of prefix tokens reused from existing cached pages."""
        return _host.call("ws.state", self._h())["cached_tokens"]

    def fork(self, pipe: "Pipeline | None" = None) -> "WorkingSet":
        """A child working set sharing this one's frozen prefix (after the passes submitted
        so far have run)."""
        child = WorkingSet()
        child._handle = _host.call("ws.fork", self._h())
        return child

    def reserve(self, end: int) -> None:
        """Writable slots [0, end) for passes that choose their slots explicitly."""
        _host.call("ws.reserve", [self._h(), int(end)])


class StateGeometry:
    """How a pass's rows are placed in its working sets. `folding()` appends them causally
    and freezes them; explicit `positions`/`slots`/`kv_len`/`fold` place them yourself."""

    def __init__(self, positions=None, slots=None, kv_len=None, fold=True) -> None:
        self.positions = None if positions is None else [int(p) for p in positions]
        self.slots = None if slots is None else [int(s) for s in slots]
        self.kv_len = None if kv_len is None else int(kv_len)
        self.fold = fold if isinstance(fold, bool) else int(fold)

    @classmethod
    def folding(cls) -> "StateGeometry":
        return _FOLDING

    def _fields(self) -> dict:
        out = {}
        if self.positions is not None:
            out["positions"] = self.positions
        if self.slots is not None:
            out["slots"] = self.slots
        if self.kv_len is not None:
            out["kv_len"] = self.kv_len
        if self.fold is not True:
            out["fold"] = self.fold
        return out


_FOLDING = StateGeometry()


# ---------------------------------------------------------------------------------------------
# tracing

class Tensor:
    """A placeholder for a device tensor while an epilogue is traced."""

    __slots__ = ("_ref",)

    def __init__(self, ref: int) -> None:
        self._ref = ref

    def __repr__(self) -> str:
        return f"Tensor(%{self._ref})"

    def __bool__(self):
        raise TypeError("a traced tensor has no truth value at trace time; use select(cond, a, b)")

    def __add__(self, o): return _record("add", self, o)
    def __radd__(self, o): return _record("add", o, self)
    def __sub__(self, o): return _record("sub", self, o)
    def __rsub__(self, o): return _record("sub", o, self)
    def __mul__(self, o): return _record("mul", self, o)
    def __rmul__(self, o): return _record("mul", o, self)
    def __truediv__(self, o): return _record("div", self, o)
    def __rtruediv__(self, o): return _record("div", o, self)
    def __neg__(self): return _record("neg", self)


_tracing: list | None = None     # the op list of the trace in progress


def _arg(value):
    if isinstance(value, Tensor):
        return {"t": value._ref}
    if isinstance(value, (list, tuple)):
        return [_arg(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"an eta operation cannot take {type(value).__name__} values")


def _record(op: str, *args) -> Tensor:
    if _tracing is None:
        raise RuntimeError(f"eta operation {op!r} used outside an epilogue or prologue "
                           "(they run on the device, traced by fwd.epilogue(f))")
    _tracing.append([op, [_arg(a) for a in args]])
    return Tensor(len(_tracing) - 1)


def trace(f) -> dict:
    """Trace `f()` into the IR {"ops": [...], "outputs": [...]}."""
    global _tracing
    if _tracing is not None:
        raise RuntimeError("epilogues cannot be traced inside another trace")
    _tracing = []
    try:
        out = f()
        ops = _tracing
    finally:
        _tracing = None
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    for o in outs:
        if not isinstance(o, Tensor):
            raise TypeError(f"an epilogue must return eta tensors, got {type(o).__name__}")
    return {"ops": ops, "outputs": [o._ref for o in outs]}


class intrinsics:
    """Model outputs an epilogue can read."""

    @staticmethod
    def output(lane: int, name: str) -> Tensor:
        """The named model output (e.g. "logits") of `lane`'s read-out rows."""
        return _record("output", int(lane), str(name))


def _make_op(name: str, op: str):
    def fn(*args):
        return _record(op, *args)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"The eta operation {op!r} (recorded while an epilogue is traced)."
    return fn


# The operations of the API reference; each records itself while tracing. The host decides
# which it can run (see runtime.ir_to_epilogue).
_OPS = ["add", "sub", "mul", "div", "neg", "abs", "exp", "log", "cos", "l2norm", "matmul",
        "max_elem", "min_elem", "eq", "ne", "lt", "le", "gt", "ge", "and_", "select",
        "mask_apply", "reshape", "broadcast", "cast", "constant", "iota", "indptr",
        "reduce_max", "reduce_sum", "reduce_argmax", "cumsum", "cumprod", "cummass_le",
        "softmax", "log_softmax", "entropy", "entropy_from_logprobs", "top_k",
        "nucleus_sample", "gumbel", "gumbel_max", "masked_argmax", "gather", "gather_row",
        "causal_mask"]
for _name in _OPS:
    globals()[_name] = _make_op(_name, _name.rstrip("_"))
__all__ += _OPS
del _name


# ---------------------------------------------------------------------------------------------
# forward passes and pipelines

_epilogue_ids: dict[str, int] = {}   # IR text -> the host's compiled epilogue id (per run)
_traced: dict = {}                    # (code, closure values, defaults) -> compiled epilogue id
_PLAIN = (bool, int, float, str, type(None))


def _trace_key(f):
    """A key under which `f`'s trace can be reused: its code plus the plain values it closes
    over (the same lambda written in a loop is traced once). None: trace every time."""
    code = getattr(f, "__code__", None)
    if code is None:
        return None
    try:
        values = tuple(c.cell_contents for c in (f.__closure__ or ()))
    except ValueError:        # an empty cell
        return None
    defaults = f.__defaults__ or ()
    if not all(isinstance(v, _PLAIN) for v in values + defaults):
        return None
    return code, values, defaults


class _Result:
    """The awaitable an epilogue returns: resolves to the epilogue's output once the pass ran."""

    __slots__ = ("_fut",)

    def __init__(self) -> None:
        self._fut = None

    def _future(self):
        if self._fut is None:
            self._fut = _host.new_future()
        return self._fut

    def __await__(self):
        return self._future().__await__()

    def done(self) -> bool:
        return self._fut is not None and self._fut.done()

    def result(self):
        return self._future().result()


class ForwardPass:
    """One run of the model over some input rows."""

    def __init__(self) -> None:
        self._tokens: list[int] | None = None
        self._indptr: list[int] | None = None
        self._ws: list[WorkingSet] | None = None
        self._geometry: StateGeometry = _FOLDING
        self._readout: list[int] | None = None
        self._epilogue: int | None = None
        self._result: _Result | None = None
        self._submitted = False

    def embed(self, tokens, indptr=None) -> "ForwardPass":
        """Input token ids; `indptr` ([0, n0, n0+n1, ...]) splits them into lanes."""
        self._tokens = [int(t) for t in tokens]
        self._indptr = None if indptr is None else [int(i) for i in indptr]
        return self

    def state(self, working_sets, geometry: StateGeometry | None = None) -> "ForwardPass":
        """The working set each lane extends, and how rows are placed (default: folding)."""
        if isinstance(working_sets, WorkingSet):
            working_sets = [working_sets]
        self._ws = list(working_sets)
        self._geometry = geometry if geometry is not None else _FOLDING
        return self

    def readout(self, indices) -> "ForwardPass":
        """Input rows (indices over all the pass's rows) whose outputs reach the epilogue;
        default: the last row of each lane."""
        self._readout = [int(i) for i in indices]
        return self

    def epilogue(self, f) -> _Result:
        """Attach device code run after the pass; returns an awaitable of its result.
        Usable as a decorator."""
        key = _trace_key(f)
        eid = _traced.get(key) if key is not None else None
        if eid is None:
            ir = _dumps(trace(f))
            eid = _epilogue_ids.get(ir)
            if eid is None:
                eid = _epilogue_ids[ir] = _host.call("eta.epilogue", ir)
            if key is not None:
                _traced[key] = eid
        self._epilogue = eid
        self._result = _Result()
        return self._result

    def _lanes(self) -> list[dict]:
        if self._tokens is None:
            raise ValueError("a forward pass needs input: call fwd.embed(tokens) first")
        if not self._ws:
            raise ValueError("a forward pass needs working sets: call fwd.state([ws], geometry) first")
        bounds = self._indptr if self._indptr is not None else [0, len(self._tokens)]
        n_lanes = len(bounds) - 1
        if n_lanes < 1 or bounds[0] != 0 or bounds[-1] != len(self._tokens) or \
                any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"indptr {bounds} does not split {len(self._tokens)} tokens into lanes")
        if len(self._ws) != n_lanes:
            raise ValueError(f"{n_lanes} lanes but {len(self._ws)} working sets")
        geometry = self._geometry._fields()
        lanes = []
        for i in range(n_lanes):
            lo, hi = bounds[i], bounds[i + 1]
            lane = {"ws": self._ws[i]._h(), "tokens": self._tokens[lo:hi], **geometry}
            if self._readout is not None:
                lane["readout"] = [r - lo for r in self._readout if lo <= r < hi]
            lanes.append(lane)
        return lanes


class Pipeline:
    """Passes submitted to a pipeline run in submission order; `submit` never blocks."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self._id = next(Pipeline._ids)
        self._closed = False

    def submit(self, fwd: ForwardPass) -> None:
        if self._closed:
            raise RuntimeError("submit on a closed pipeline")
        if fwd._submitted:
            raise RuntimeError("this forward pass was already submitted")
        fid = _host.call("eta.submit", {"pipe": self._id, "lanes": fwd._lanes(),
                                        "epilogue": fwd._epilogue})
        fwd._submitted = True
        result = fwd._result if fwd._result is not None else _Result()
        _host.future(fid, result._future())

    def close(self) -> None:
        """No more passes; those already submitted still run."""
        self._closed = True
