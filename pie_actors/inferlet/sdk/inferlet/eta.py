"""Forward passes, working sets, pipelines, channels and epilogues (the `eta` device-program API).

An inferlet builds a `ForwardPass` (input tokens or a channel, the working sets its lanes
extend, the rows read out, an epilogue), submits it to a `Pipeline` without blocking, and
awaits the epilogue's result.

Epilogues (and prologues) are *traced*: `fwd.epilogue(f)` calls `f()` once with placeholder
tensors, and every eta operation it applies is recorded into a small IR,
``{"ops": [[op, args], ...], "outputs": [ref, ...]}``, where a tensor argument is
``{"t": index of the op that made it}``. The engine compiles each distinct IR once
(`pie_actors.gpu.eta`: torch, or a fused Triton kernel on CUDA) and runs it right after the
model; a bad program is refused when it is traced. Python control flow runs at trace time;
use `select` to branch on values.

Channels are queues in the engine's memory. `put`/`take` inside a traced function run on the
device; outside one they are host operations. A pass can take its input tokens from a channel,
so an epilogue can feed the next pass without a host round trip (`Pipeline.run_ahead`).
"""
from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from functools import partial

from . import _host
from .mask import Mask

__all__ = ["ForwardPass", "Pipeline", "StateGeometry", "WorkingSet", "Tensor", "Channel", "dtype",
           "intrinsics", "trace", "generate"]

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode


# ---------------------------------------------------------------------------------------------
# working sets

_dropped: list[int] = []     # handles of working sets the program no longer references


def _free_dropped() -> None:
    """Tell the host about dropped working sets (at the next host call that makes or runs
    passes: a finalizer must not call the host itself)."""
    if _dropped:
        handles = _dropped[:]
        _dropped.clear()
        _host.call("ws.free", handles)


class WorkingSet:
    """One sequence's state inside the model (KV cache, recurrent state). The host side is
    made on first use, so creating one costs nothing until a pass references it. When the
    program drops it, its pages return (once the passes already submitted on it have run).

    `save(name)` keeps its frozen prefix beyond the program's end, and `WorkingSet.open(name)`
    brings it back in a later run of the same owner; `restored` then says how: "kept" (its pages
    were still in the engine), "spilled" (copied back from host memory) or "recomputed" (its
    tokens were prefilled again). The tokens that follow are the same in every case."""

    def __init__(self) -> None:
        self._handle: int | None = None
        self.restored: str | None = None      # how `open` brought it back; None: made here

    def __del__(self) -> None:
        if self._handle is not None:
            _dropped.append(self._handle)

    def _h(self) -> int:
        if self._handle is None:
            _free_dropped()
            self._handle = _host.call("ws.create")
        return self._handle

    def folded(self) -> int:
        """Number of tokens in the frozen prefix."""
        return _host.call("ws.state", self._h())["folded"]

    def cached_tokens(self) -> int:
        """Number of prefix tokens reused from existing cached pages."""
        return _host.call("ws.state", self._h())["cached_tokens"]

    def fork(self, pipe: "Pipeline | None" = None) -> "WorkingSet":
        """A child working set sharing this one's frozen prefix, as it is once the passes
        submitted so far on this working set have run (fork waits for them)."""
        child = WorkingSet()
        child._handle = _host.call("ws.fork", self._h())
        return child

    def reserve(self, end: int) -> None:
        """Writable slots [0, end) for passes that choose their slots explicitly."""
        _host.call("ws.reserve", [self._h(), int(end)])

    def save(self, name: str) -> int:
        """Keep the frozen prefix (as it is once the passes submitted so far have run) under
        `name`, replacing what this owner saved under it; returns its number of tokens. Only
        working sets written by folding passes can be saved (their tokens recompute them)."""
        return _host.call("ws.save", [self._h(), str(name)])

    @classmethod
    def open(cls, name: str) -> "WorkingSet":
        """A new working set holding what this owner saved under `name` (it stays saved)."""
        _free_dropped()
        opened = _host.call("ws.open", str(name))
        ws = cls()
        ws._handle, ws.restored = opened["ws"], opened["restored"]
        return ws

    @staticmethod
    def saved() -> list:
        """This owner's saved working sets: {"name", "state" ("kept", "spilled", "tokens"),
        "tokens"}, by name."""
        return _host.call("ws.saved")

    @staticmethod
    def delete_saved(name: str) -> None:
        """Forget the saved working set `name`; its pages return."""
        _host.call("ws.delete_saved", str(name))


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


def trace(f, nargs: int = 0) -> dict:
    """Trace `f(*args)` into the IR {"ops": [...], "outputs": [...]}; its `nargs` arguments are
    placeholders (adapters: x and y). `f` returns a tensor, a list of tensors, or None (a
    function that only puts into channels)."""
    global _tracing
    if _tracing is not None:
        raise RuntimeError("epilogues cannot be traced inside another trace")
    _tracing = []
    try:
        out = f(*[_record("arg", i) for i in range(nargs)])
        ops = _tracing
    finally:
        _tracing = None
    outs = [] if out is None else list(out) if isinstance(out, (list, tuple)) else [out]
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
# channels

class dtype:
    """Element types of channels and of `cast`/`constant`/`iota`."""

    f32, f16, bf16, i32, i64, u32, bool = "f32", "f16", "bf16", "i32", "i64", "u32", "bool"


def _shape_of(values) -> list[int]:
    shape = []
    while isinstance(values, (list, tuple)):
        shape.append(len(values))
        values = values[0] if values else None
    return shape


_ready: dict[int, deque] = {}                   # channel handle -> values the host handed over, not taken yet
_waiting: dict[int, list[asyncio.Future]] = {}  # channel handle -> readers waiting for the host's next values


def _fetched(handle: int, values: list | None, error: _host.HostError | None) -> None:
    """The host future of a channel's next values completed: keep them, wake its readers."""
    if error is None:
        _ready.setdefault(handle, deque()).extend(values)
    for reader in _waiting.pop(handle):
        if not reader.done():                  # not cancelled
            reader.set_result(None) if error is None else reader.set_exception(error)


def _scalar(value):
    while isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"take_scalar read a value of {len(value)} elements; use take()")
        value = value[0]
    return value


class Channel:
    """A typed queue in the engine's memory, of values of one `shape` and `dtype`.

    Created on first use, so `.capacity(n)` (default 1) can follow the constructor. `put`/`take`
    inside a traced epilogue or prologue run on the device; outside, they are host operations.
    A channel read on the host with `await take_scalar()` becomes device -> host: the engine
    sends each value put into it to the host as it is produced."""

    def __init__(self, shape, dtype: str = dtype.i32) -> None:
        self._shape = [int(d) for d in shape]
        self._dtype = str(dtype)
        self._capacity = 1
        self._values = None
        self._handle: int | None = None

    @classmethod
    def from_(cls, values, dtype: str = dtype.i32) -> "Channel":
        """A channel holding `values` (its shape is theirs) as its first element."""
        chan = cls(_shape_of(values), dtype)
        chan._values = values
        return chan

    def capacity(self, n: int) -> "Channel":
        """How many values the channel can buffer; set it before the channel is used."""
        if self._handle is not None:
            raise RuntimeError("set a channel's capacity before its first use")
        self._capacity = int(n)
        return self

    def _h(self) -> int:
        if self._handle is None:
            self._handle = _host.call("chan.create", {"shape": self._shape, "dtype": self._dtype,
                                                      "capacity": self._capacity, "values": self._values})
        return self._handle

    def put(self, value) -> None:
        """Enqueue a value (on the device inside a traced function, from the host otherwise).
        A mask from `mask.unpack_mask` crosses as its packed words."""
        if _tracing is not None:
            _record("put", self._h(), value)
        elif isinstance(value, Mask):
            _host.call("chan.put_bits", [self._h(), value.words, len(value)])
        else:
            _host.call("chan.put", [self._h(), value])

    def take(self):
        """Dequeue a value: a tensor inside a traced function, a (nested) list on the host."""
        if _tracing is not None:
            return _record("take", self._h())
        ready = _ready.get(self._h())
        if ready:
            return ready.popleft()
        return _host.call("chan.take", self._h())

    async def take_scalar(self):
        """The next value, as a number, once the device has put it. The host hands over every value
        that has arrived at once, and the next reads take theirs from those without a host call;
        readers waiting together share one wait for the values to come, and each gets the next."""
        handle = self._h()
        while True:
            ready = _ready.get(handle)
            if ready:
                value = _scalar(ready[0])       # a value that is not a scalar stays, for take()
                ready.popleft()
                return value
            readers = _waiting.get(handle)
            if readers is None:
                got = _host.call("chan.take_scalar", handle)
                if "values" in got:
                    _ready[handle] = deque(got["values"])
                    continue
                readers = _waiting[handle] = []
                _host.on_complete(got["future"], partial(_fetched, handle))
            reader = _host.new_future()     # its own: a reader cancelled leaves the values to the next
            readers.append(reader)
            await reader

    def _layout(self) -> list[int]:
        """The values of a host-filled channel used as a pass's lane layout (indptr)."""
        if self._values is None:
            raise ValueError("a channel used as indptr must be made with Channel.from_(offsets)")
        return [int(v) for v in self._values]


# ---------------------------------------------------------------------------------------------
# forward passes and pipelines

_programs: dict[str, int] = {}   # IR text -> the engine's program id (per run)
_traced: dict = {}               # (code, closure values, defaults) -> program id
_PLAIN = (bool, int, float, str, type(None))


def _key_value(v):
    # by type and bits, not by ==: 1, 1.0 and True trace to different IR, and so do 0.0 and -0.0
    if isinstance(v, float):
        return float, v.hex()
    if isinstance(v, _PLAIN):
        return type(v), v
    if isinstance(v, Channel):
        return ("channel", v._h())
    raise TypeError


def _trace_key(f):
    """A key under which `f`'s trace can be reused: its code plus the plain values and channels
    it closes over (the same lambda written in a loop is traced once). None: trace every time."""
    code = getattr(f, "__code__", None)
    if code is None:
        return None
    try:
        values = tuple(_key_value(c.cell_contents) for c in (f.__closure__ or ()))
        defaults = tuple(_key_value(d) for d in (f.__defaults__ or ()))
    except (ValueError, TypeError):        # an empty cell, or a value that is not plain
        return None
    return code, values, defaults


def _program(f, nargs: int = 0) -> int:
    """The engine's program id for the traced function `f` (traced and registered once)."""
    key = _trace_key(f)
    pid = _traced.get(key) if key is not None else None
    if pid is None:
        ir = _dumps(trace(f, nargs))
        pid = _programs.get(ir)
        if pid is None:
            pid = _programs[ir] = _host.call("eta.program", ir)
        if key is not None:
            _traced[key] = pid
    return pid


class _Result:
    """The awaitable an epilogue returns: resolves to the epilogue's output once the pass ran
    (a number or list for one output, a list of them for several)."""

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
        self._channel: Channel | None = None
        self._indptr: list[int] | None = None
        self._ws: list[WorkingSet] | None = None
        self._geometry: StateGeometry = _FOLDING
        self._readout: list[int] | None = None
        self._checkpoints: list[int] | None = None
        self._mask: list | None = None
        self._epilogue: int | None = None
        self._prologue: int | None = None
        self._adapters: list[list] = []
        self._result: _Result | None = None
        self._submitted = False

    def embed(self, tokens, indptr=None) -> "ForwardPass":
        """Input token ids, or a Channel whose next value holds them (taken when the pass runs);
        `indptr` ([0, n0, n0+n1, ...], a list or a Channel.from_ of one) splits them into lanes."""
        if isinstance(tokens, Channel):
            self._channel, self._tokens = tokens, None
        else:
            self._tokens, self._channel = [int(t) for t in tokens], None
        if isinstance(indptr, Channel):
            indptr = indptr._layout()
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

    def mask(self, rows) -> "ForwardPass":
        """Per-row attention masks: for each input row (over all lanes), one bool per slot of
        its lane's attended span (kv_len) -- True: the row attends to that slot."""
        self._mask = [[bool(b) for b in row] for row in rows]
        return self

    def group(self, lane: int, id: int) -> "ForwardPass":
        """Group lanes that share attention state. Here every lane has its own working set and
        the pass's lanes always run in one batch, so grouping changes nothing; it is accepted so
        programs written for engines that share state across lanes run unchanged."""
        self._lane_index(lane)
        return self

    def input(self, lane: int, name: str, channel) -> "ForwardPass":
        raise ValueError(f"the model declares no extra input {name!r}: it takes only tokens")

    def switch(self, lane: int, name: str, value) -> "ForwardPass":
        raise ValueError(f"the model declares no switch {name!r} (it has none)")

    def media(self, lane: int, spans) -> "ForwardPass":
        raise ValueError("the model is text-only: it takes no image or audio spans")

    def checkpoints(self, slots) -> "ForwardPass":
        """Keep the recurrent state of each lane's working set at these slots (its lengths after
        that many rows), so that a later pass can cut the set back to one of them (a speculative
        tail rolled back) on a model with recurrent layers. Slots outside the pass's rows fail the
        pass. Attention-only models have no recurrent state: there it keeps nothing."""
        self._checkpoints = [int(s) for s in slots]
        return self

    def adapter(self, site: str, f) -> "ForwardPass":
        """At projection `site` ("q", "k", "v", "o", "gate", "up", "down" in every layer, or
        "layers.<i>.<site>"), replace this pass's projection output y by f(x, y), x being the
        projection's input rows: f is traced like an epilogue (a LoRA adapter is
        `lambda x, y: y + matmul(matmul(x, A), B)` with A, B from `constant`). Its KV is the
        adapted model's, so it is never shared with other requests through the prefix cache."""
        self._adapters.append([str(site), _program(f, 2)])
        return self

    def prologue(self, f) -> "ForwardPass":
        """Device code run before the model pass (traced like an epilogue; its effects are
        channel puts, e.g. preparing the pass's input channel)."""
        self._prologue = _program(f)
        return self

    def epilogue(self, f) -> _Result:
        """Attach device code run after the pass; returns an awaitable of its result.
        Usable as a decorator."""
        self._epilogue = _program(f)
        self._result = _Result()
        return self._result

    def _lane_index(self, lane: int) -> int:
        lanes = (len(self._indptr) - 1) if self._indptr is not None else 1
        if not 0 <= int(lane) < lanes:
            raise ValueError(f"lane {lane} does not exist: the pass has {lanes} lane(s)")
        return int(lane)

    def _spec(self) -> dict:
        """The host's pass spec: lanes, epilogue and prologue program ids."""
        return {"lanes": self._lanes(), "epilogue": self._epilogue, "prologue": self._prologue,
                "adapters": self._adapters}

    def _lanes(self) -> list[dict]:
        if self._tokens is None and self._channel is None:
            raise ValueError("a forward pass needs input: call fwd.embed(tokens) first")
        if not self._ws:
            raise ValueError("a forward pass needs working sets: call fwd.state([ws], geometry) first")
        n = len(self._tokens) if self._tokens is not None else _count(self._channel._shape)
        bounds = self._indptr if self._indptr is not None else [0, n]
        n_lanes = len(bounds) - 1
        if n_lanes < 1 or bounds[0] != 0 or bounds[-1] != n or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"indptr {bounds} does not split {n} tokens into lanes")
        if len(self._ws) != n_lanes:
            raise ValueError(f"{n_lanes} lanes but {len(self._ws)} working sets")
        if self._channel is not None and n_lanes != 1:
            raise ValueError("a pass taking its tokens from a channel has one lane")
        if self._mask is not None and len(self._mask) != n:
            raise ValueError(f"mask has {len(self._mask)} rows for {n} input rows")
        geometry = self._geometry._fields()
        lanes = []
        for i in range(n_lanes):
            lo, hi = bounds[i], bounds[i + 1]
            lane = {"ws": self._ws[i]._h(), **geometry}
            if self._channel is not None:
                lane["chan"], lane["tokens"] = self._channel._h(), []
            else:
                lane["tokens"] = self._tokens[lo:hi]
            if self._readout is not None:
                lane["readout"] = [r - lo for r in self._readout if lo <= r < hi]
            if self._checkpoints is not None:
                lane["checkpoints"] = self._checkpoints
            if self._mask is not None:
                lane["mask"] = self._mask[lo:hi]
            lanes.append(lane)
        return lanes


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Pipeline:
    """Passes submitted to a pipeline run in submission order; `submit` never blocks."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self._id = next(Pipeline._ids)
        self._closed = False

    def _check(self, fwd: ForwardPass) -> None:
        if self._closed:
            raise RuntimeError("submit on a closed pipeline")
        if fwd._submitted:
            raise RuntimeError("this forward pass was already submitted")

    def submit(self, fwd: ForwardPass) -> None:
        """Queue one forward pass."""
        self._check(fwd)
        _free_dropped()
        fid = _host.call("eta.submit", fwd._spec())
        fwd._submitted = True
        result = fwd._result if fwd._result is not None else _Result()
        _host.future(fid, result._future())

    def submit_frame(self, passes) -> None:
        """Queue passes that run in back-to-back scheduler waves, in order. (The engine keeps
        each working set's passes in order and batches independent ones together.)"""
        for fwd in passes:
            self.submit(fwd)

    async def run_ahead(self, fwd: ForwardPass, budget: int, on_token, wake_every: int = 1) -> int:
        """Run `fwd` again and again on the engine (its input usually a channel its epilogue
        feeds) until `on_token()` returns False or `budget` runs were read. The engine keeps up
        to twice `model.run_ahead_window()` runs in flight; the host tells it how far it has read
        once per window. Runs past the stop are cut off the working sets. Returns the runs kept.

        `wake_every` (1 to `model.run_ahead_window()`): a read of the epilogue's channels that has
        to wait is woken once that many values are there (or the budget's runs are done), so
        `on_token` runs in bursts and the program wakes once per burst, which saves its host CPU
        (bench/RESULTS.md). The tokens are the same; what it costs is when the loop stops early (a
        stop token): the stop is seen up to `wake_every - 1` runs later, and those runs are computed
        and cut off. So 1 (each token as it comes) suits a stream and a reply that ends at a stop
        token; more suits a loop that reads a known number of tokens."""
        self._check(fwd)
        from . import model
        window, wake_every = model.run_ahead_window(), int(wake_every)
        if not 1 <= wake_every <= window:
            raise ValueError(f"wake_every must be from 1 to model.run_ahead_window() ({window}), got {wake_every}")
        _free_dropped()
        run = _host.call("eta.run_ahead", {**fwd._spec(), "budget": int(budget), "window": 2 * window,
                                           "wake_every": wake_every})
        fwd._submitted = True
        done = _host.future(run["done"])
        read = 0
        try:
            while read < budget:
                go = on_token()
                if hasattr(go, "__await__"):
                    go = await go
                read += 1
                if not go:
                    break
                if read % window == 0:
                    _host.call("eta.run_ahead_ack", [run["run"], read])
        finally:
            if not done.done():
                _host.call("eta.run_ahead_stop", [run["run"], read])
                for handle in run["puts"]:       # what was handed over past the stop is cut off too
                    _ready.pop(handle, None)
        return await done

    def close(self) -> None:
        """No more passes; those already submitted still run."""
        self._closed = True

    def park(self) -> None:
        """Park the program: it is about to wait (for a message, a tool, its client) and needs
        its working sets only later. Parked, its working sets are the first to leave the engine's
        KV pool when the pool runs short: their K and V rows go to host memory while
        `[engine] spill_memory_mb` has room, else only their tokens are kept. They come back before
        the program's next pass or other use of them (written back, or recomputed from their
        tokens), with the same results as if they had never left. It takes effect once the passes
        in flight have run (unless another is submitted first), and lasts until the program uses
        its working sets again. A program waiting in `session.receive()` parks by itself after
        `[limits] park_after_s`."""
        _host.call("eta.park")


# ---------------------------------------------------------------------------------------------
# the plain decoding loop

def _greedy() -> Tensor:
    return reduce_argmax(intrinsics.output(0, "logits"))


async def generate(ws: WorkingSet, pipe: Pipeline, tokens: list[int], max_tokens: int,
                   stop=(), sample=_greedy):
    """Feed `tokens` into `ws`, then decode one token a pass until a token in `stop` or
    `max_tokens` passes; yields each new token, the stop token not included. `sample` is the
    epilogue (greedy by default). Every yielded token but the last is in `ws` when the loop ends;
    the last is too when a stop token ended it (which `len(yielded) < max_tokens` tells)."""
    stop = set(stop)
    for _ in range(max_tokens):
        fwd = ForwardPass()
        fwd.embed(tokens)
        fwd.state([ws], StateGeometry.folding())
        chosen = fwd.epilogue(sample)
        pipe.submit(fwd)
        token = await chosen
        if token in stop:
            return
        yield token
        tokens = [token]
