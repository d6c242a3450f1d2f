"""Eta programs: IR validation and hashing, constant folding, the torch interpreter, the cache.

The IR is ``{"ops": [[op, args], ...], "outputs": [ref, ...]}`` (see ops.py for the ops). It is
validated statically before anything runs; shapes are only known per pass, so shape errors come
from `Program.run`. Ops that depend on no model output, channel or indptr (constants, iota,
broadcast of a number, noise with a literal seed, ...) are computed once at compile time.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .ops import MODEL_OUTPUTS, OPS, EtaError, OpSpec, argmax, flat_index, gumbel_noise, is_ref, seed_key, seed_keys

__all__ = ["Env", "LanesEnv", "TensorEnv", "Program", "ProgramCache", "compile_program", "parse"]


class Env(Protocol):
    """What a program reads and changes in the pass it runs after.

    `output` and `take` raise LookupError (KeyError, IndexError) with a message naming the
    lane/name or channel when there is no such output or the channel is empty; `run` reports
    that as an EtaError naming the op."""

    def output(self, lane: int, name: str) -> torch.Tensor:
        """The model output `name` of `lane`'s read-out rows: [vocab] for one row, [rows, vocab]."""

    def take(self, channel: int) -> torch.Tensor:
        """Dequeue one value of the channel (its element shape and dtype)."""

    def put(self, channel: int, value: torch.Tensor) -> None:
        """Enqueue `value` (copy it if it is kept: it may be a program constant)."""

    def indptr(self) -> torch.Tensor:
        """Read-out row offsets per lane, i32 [lanes + 1]."""

    def arg(self, index: int) -> torch.Tensor:
        """Argument `index` of an adapter function (LookupError when there is none)."""


class TensorEnv:
    """An Env over plain tensors: outputs by (lane, name) and channels as lists (front = next
    value; `take` pops it, `put` appends). indptr defaults to the lanes' "logits" row counts."""

    def __init__(self, outputs: dict[tuple[int, str], torch.Tensor],
                 channels: dict[int, list[torch.Tensor]] | None = None,
                 indptr: torch.Tensor | None = None, args: tuple[torch.Tensor, ...] = ()) -> None:
        self.outputs = outputs
        self.channels = {} if channels is None else channels
        self._indptr = indptr
        self.args = args

    def arg(self, index: int) -> torch.Tensor:
        if not index < len(self.args):
            raise LookupError(f"argument {index} does not exist: this program has {len(self.args)} "
                              "(arguments are for adapter functions)")
        return self.args[index]

    def output(self, lane: int, name: str) -> torch.Tensor:
        try:
            return self.outputs[lane, name]
        except KeyError:
            have = ", ".join(f"lane {l} {n!r}" for l, n in self.outputs) or "none"
            raise LookupError(f"no model output {name!r} for lane {lane} (this pass has: {have})") from None

    def _channel(self, channel: int) -> list[torch.Tensor]:
        if channel not in self.channels:
            raise LookupError(f"channel {channel} does not exist")
        return self.channels[channel]

    def take(self, channel: int) -> torch.Tensor:
        queue = self._channel(channel)
        if not queue:
            raise LookupError(f"channel {channel} is empty")
        return queue.pop(0)

    def put(self, channel: int, value: torch.Tensor) -> None:
        self._channel(channel).append(value)

    def indptr(self) -> torch.Tensor:
        if self._indptr is not None:
            return self._indptr
        lanes = sorted(lane for lane, name in self.outputs if name == "logits")
        if lanes != list(range(len(lanes))):
            raise LookupError(f"indptr needs the logits of lanes 0..n-1, this pass has lanes {lanes}")
        offsets = [0]
        for lane in lanes:
            x = self.outputs[lane, "logits"]
            offsets.append(offsets[-1] + (x.shape[0] if x.dim() == 2 else 1))
        return torch.tensor(offsets, dtype=torch.int32, device=self.outputs[0, "logits"].device)


# ---------------------------------------------------------------------------------------------
# parsing and validation

@dataclass(frozen=True)
class Node:
    index: int
    spec: OpSpec
    args: tuple
    refs: tuple[tuple[int, int], ...]     # (argument position, op index) of its tensor arguments


@dataclass(frozen=True)
class Parsed:
    text: str                  # canonical JSON
    hash: str
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]


def _canonical(ir: dict | str) -> str:
    if isinstance(ir, str):
        try:
            ir = json.loads(ir)
        except json.JSONDecodeError as e:
            raise EtaError(f"the program is not valid JSON: {e}") from None
    try:
        return json.dumps(ir, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise EtaError(f"the program is not JSON data: {e}") from None


def _node(i: int, op: Any, produced_nothing: set[int]) -> Node:
    if not (isinstance(op, list) and len(op) == 2 and isinstance(op[0], str) and isinstance(op[1], list)):
        raise EtaError(f"op {i}: must be [name, [args...]], got {op!r}")
    name, args = op
    spec = OPS.get(name)
    if spec is None:
        raise EtaError(f"op {i} ({name}): unknown op")
    problem = spec.check(args)
    if problem:
        raise EtaError(f"op {i} ({name}): {problem}")
    refs = tuple((pos, a["t"]) for pos, a in enumerate(args) if is_ref(a))
    for pos, ref in refs:
        if not 0 <= ref < i:
            raise EtaError(f"op {i} ({name}): argument {pos} refers to op {ref}, which does not come before it")
        if ref in produced_nothing:
            raise EtaError(f"op {i} ({name}): argument {pos} refers to op {ref} (put), which produces no value")
    if name == "output" and args[1] not in MODEL_OUTPUTS:
        raise EtaError(f"op {i} (output): unknown model output {args[1]!r} (known: "
                       + ", ".join(map(repr, MODEL_OUTPUTS)) + ")")
    return Node(i, spec, tuple(args), refs)


def parse(ir: dict | str) -> Parsed:
    """Validate an IR (dict or JSON text) statically; raises EtaError naming the op and problem."""
    try:
        return _parse(ir)
    except RecursionError:
        raise EtaError("the program is nested too deeply") from None


def _parse(ir: dict | str) -> Parsed:
    text = _canonical(ir)
    ir = json.loads(text)
    if not isinstance(ir, dict) or set(ir) != {"ops", "outputs"}:
        raise EtaError('a program is {"ops": [...], "outputs": [...]}, got '
                       + (f"fields {sorted(ir)}" if isinstance(ir, dict) else type(ir).__name__))
    ops, outputs = ir["ops"], ir["outputs"]
    if not isinstance(ops, list) or not isinstance(outputs, list):
        raise EtaError('"ops" and "outputs" must be lists')
    nodes: list[Node] = []
    puts: set[int] = set()
    for i, op in enumerate(ops):
        nodes.append(_node(i, op, puts))
        if nodes[-1].spec.name == "put":
            puts.add(i)
    for j, ref in enumerate(outputs):
        if not (isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < len(nodes)):
            raise EtaError(f"output {j} refers to op {ref!r}, but the program has {len(nodes)} ops")
        if ref in puts:
            raise EtaError(f"output {j} refers to op {ref} (put), which produces no value")
    digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    return Parsed(text, digest, tuple(nodes), tuple(outputs))


# ---------------------------------------------------------------------------------------------
# running

_RUN_ERRORS = (RuntimeError, ValueError, TypeError, LookupError, ArithmeticError)


def _reason(e: Exception) -> str:
    """The message of an error (a KeyError's str() quotes it); the first line of torch's."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def _failure(node: Node, args: list, e: Exception) -> EtaError:
    shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
    on = f" on shapes {', '.join(map(str, shapes))}" if shapes and not isinstance(e, LookupError) else ""
    return EtaError(f"op {node.index} ({node.spec.name}){on}: {_reason(e)}")


def call(node: Node, values: list | dict[int, Any], env: Any) -> Any:
    """Apply one node to the values computed so far (errors become EtaError naming the op)."""
    args = list(node.args)
    for pos, ref in node.refs:
        args[pos] = values[ref]
    try:
        return node.spec.impl(env, *args) if node.spec.env else node.spec.impl(*args)
    except torch.OutOfMemoryError:
        raise                            # the engine's problem, not the program's
    except EtaError as e:
        raise EtaError(f"op {node.index} ({node.spec.name}): {e}") from None
    except _RUN_ERRORS as e:
        raise _failure(node, args, e) from e


def fold(parsed: Parsed, device: torch.device) -> dict[int, torch.Tensor]:
    """Values of the ops that depend on no pass (no env op upstream), computed on `device`."""
    consts: dict[int, torch.Tensor] = {}
    values: list = [None] * len(parsed.nodes)
    with torch.device(device):
        for node in parsed.nodes:
            if node.spec.env or any(ref not in consts for _, ref in node.refs):
                continue
            value = call(node, values, None)
            values[node.index] = consts[node.index] = torch.as_tensor(value)
    return consts


# Ops that run for many one-row passes at once with the passes stacked on a leading dimension
# (`Program.run_lanes`): elementwise ops (their operands' pass dimensions aligned), ops on the last
# axis (which is never the pass dimension), and the env and shape ops written out in `_lane_call`.
_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "neg", "abs", "exp", "log", "cos", "max_elem",
                          "min_elem", "eq", "ne", "lt", "le", "gt", "ge", "and", "select", "mask_apply",
                          "cast"})
_LAST_AXIS = frozenset({"reduce_max", "reduce_sum", "reduce_argmax", "softmax", "log_softmax", "l2norm",
                        "entropy", "entropy_from_logprobs", "top_k", "cumsum", "cumprod", "cummass_le",
                        "masked_argmax"})
_LANE_OPS = _ELEMENTWISE | _LAST_AXIS | {"output", "take", "put", "reshape", "gather", "gumbel_max"}


class _NotLanewise(Exception):
    """A value met at run time that the stacked form cannot compute as each pass alone would."""


def lanewise(parsed: Parsed, consts: dict[int, torch.Tensor]) -> bool:
    """Whether the program can run once for the single read-out rows of many passes, each with its
    own channels (`Program.run_lanes`): it reads lane 0 only, its ops are in _LANE_OPS, and it
    takes from a channel at most once and never after putting into it (the stacked run takes
    every pass's values before it puts any)."""
    taken: set[int] = set()
    put: set[int] = set()
    for node in parsed.nodes:
        if node.index in consts:
            continue
        name = node.spec.name
        if name not in _LANE_OPS or (name == "output" and node.args[0] != 0):
            return False
        if name == "take":
            if node.args[0] in taken or node.args[0] in put:
                return False
            taken.add(node.args[0])
        elif name == "put":
            put.add(node.args[0])
    return True


def _lane_key(parsed: Parsed, slots: tuple[int, ...]) -> str:
    """The program's hash with its channels numbered by first use: programs that differ only in
    which channels they use share it (and one stacked run)."""
    slot = {cid: i for i, cid in enumerate(slots)}
    ops = [[name, [slot[args[0]], *args[1:]] if name in ("take", "put") else args]
           for name, args in json.loads(parsed.text)["ops"]]
    text = json.dumps({"ops": ops, "outputs": list(parsed.outputs)}, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class LanesEnv(Protocol):
    """What a program run for many passes at once (`Program.run_lanes`) reads and changes: the
    passes' lane-0 outputs stacked [passes, vocab]; each pass's channel values stacked (the
    program's channel ids name the first pass's channels; the env maps them to each pass's own);
    puts of per-pass values (row p is pass p's) or of one value for all."""

    passes: int

    def output(self, lane: int, name: str) -> torch.Tensor: ...

    def take(self, channel: int) -> torch.Tensor: ...

    def put(self, channel: int, value: torch.Tensor, per_pass: bool) -> None: ...


def _aligned(args: list, lanes: set[int]) -> list:
    """The operands with their pass dimensions lined up: a per-pass value of lower rank than the
    others gets unit dimensions after its pass dimension, so that each pass's values broadcast
    as they do alone (where ranks align from the right)."""
    rank = max((a.dim() - (pos in lanes) for pos, a in enumerate(args) if isinstance(a, torch.Tensor)), default=0)
    for pos in lanes:
        a = args[pos]
        if a.dim() - 1 < rank:
            args[pos] = a.reshape(a.shape[0], *[1] * (rank - a.dim() + 1), *a.shape[1:])
    return args


def _lane_gumbel_max(x: torch.Tensor, seed: Any, per_pass_seed: bool) -> torch.Tensor:
    x = x.float()
    shape = x.shape[1:]
    if per_pass_seed:
        if seed.dtype.is_floating_point or seed.dtype == torch.bool or seed[0].numel() != 1:
            raise _NotLanewise("a seed must be one integer a pass")
        key = seed_keys(seed.reshape(-1).to(torch.int64)).reshape(-1, *[1] * len(shape))
    else:
        key = seed_key(seed)
    return argmax(x + gumbel_noise(flat_index(shape, x.device), key))


def _lane_call(node: Node, values: list, env: LanesEnv, consts: dict[int, torch.Tensor]) -> Any:
    """One node on stacked values: every value not folded has the passes' leading dimension."""
    args = list(node.args)
    lanes = set()
    for pos, ref in node.refs:
        args[pos] = values[ref]
        if ref not in consts:
            lanes.add(pos)
    name = node.spec.name
    if name == "output":
        return env.output(*args).float()
    if name == "take":
        return env.take(args[0])
    if name == "put":
        env.put(args[0], args[1], 1 in lanes)
        return None
    if name in _ELEMENTWISE:
        return node.spec.impl(*_aligned(args, lanes))
    if 0 not in lanes:                   # every op left reads a per-pass tensor first
        raise _NotLanewise(f"op {node.index} ({name}) on a constant")
    if name == "reshape":
        return torch.reshape(args[0], [args[0].shape[0], *args[1]])
    if name == "gather":
        if isinstance(args[1], torch.Tensor) and 1 not in lanes:
            raise _NotLanewise(f"op {node.index} (gather) with constant indices")
        return node.spec.impl(*args)     # both stacked: their ranks keep their relation
    if name == "gumbel_max":
        return _lane_gumbel_max(args[0], args[1], 1 in lanes)
    if args[0].dim() < 2:                # the last axis would be the passes'
        raise _NotLanewise(f"op {node.index} ({name}) on a per-pass number")
    return node.spec.impl(*_aligned(args, lanes))


class Program:
    """A compiled eta program. Run it once per pass with the pass's Env.

    Output tensors are on the program's device; treat them as read-only (an output that is a
    constant is the same tensor every run). `lanewise` programs may also run once for the single
    read-out rows of many passes (`run_lanes`): one launch a batch instead of one a pass; programs
    that differ only in their channels share a `lane_key` and so a run."""

    backend = "torch"

    def __init__(self, parsed: Parsed, consts: dict[int, torch.Tensor], device: torch.device) -> None:
        self.hash = parsed.hash
        self.ir = parsed.text
        self.device = device
        self.reads: list[tuple[int, str]] = list(dict.fromkeys(
            tuple(n.args) for n in parsed.nodes if n.spec.name == "output"))
        self.outputs = parsed.outputs
        self.nodes = parsed.nodes
        self.consts = consts
        self._steps = [n for n in parsed.nodes if n.index not in consts]
        self.slots = tuple(dict.fromkeys(n.args[0] for n in parsed.nodes if n.spec.name in ("take", "put")))
        self.channels = frozenset(self.slots)
        self.lanewise = lanewise(parsed, consts)
        self.lane_key = _lane_key(parsed, self.slots) if self.lanewise else None

    def evaluate(self, env: Env, consts: dict[int, torch.Tensor]) -> list:
        """Every op's value (None for put), with `consts` standing for the folded ops."""
        values: list = [None] * len(self.nodes)
        for i, c in consts.items():
            values[i] = c
        for node in self._steps:
            values[node.index] = call(node, values, env)
        return values

    def run(self, env: Env) -> list[torch.Tensor]:
        """The program's output tensors for one pass; a bad shape or missing input raises EtaError."""
        values = self.evaluate(env, self.consts)
        return [values[o] for o in self.outputs]

    def run_lanes(self, env: LanesEnv) -> list[torch.Tensor]:
        """A `lanewise` program's outputs for `env.passes` one-row passes at once, each [passes, ...]:
        row p is what pass p alone would get. Raises (and has put nothing) where a value's shape
        does not allow the stacked form; the caller then runs each pass alone."""
        values: list = [None] * len(self.nodes)
        for i, c in self.consts.items():
            values[i] = c
        for node in self._steps:
            values[node.index] = _lane_call(node, values, env, self.consts)
        return [values[o] if o not in self.consts else values[o].expand(env.passes, *values[o].shape)
                for o in self.outputs]

    def __repr__(self) -> str:
        return f"<eta Program {self.hash[:12]} {self.backend} {len(self.nodes)} ops>"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compile_program(ir: dict | str, *, device: torch.device | str, backend: str = "auto") -> Program:
    """Validate and compile an IR. backend: "torch", "triton" (EtaError naming the first op it
    cannot fuse) or "auto" (Triton on CUDA when it is importable and supports the program)."""
    return _compile(parse(ir), torch.device(device), backend)


def _compile(parsed: Parsed, device: torch.device, backend: str) -> Program:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown eta backend {backend!r} (auto, torch, triton)")
    consts = fold(parsed, device)
    if backend == "torch" or (backend == "auto" and not (device.type == "cuda" and _triton_available())):
        return Program(parsed, consts, device)
    from . import triton_backend

    problem = triton_backend.unsupported(parsed, consts)
    if problem is None:
        return triton_backend.TritonProgram(parsed, consts, device)
    if backend == "triton":
        raise EtaError(problem)
    return Program(parsed, consts, device)


class ProgramCache:
    """Compiled programs by (IR hash, device), least recently used dropped beyond `capacity`.
    One per engine; thread-safe."""

    def __init__(self, backend: str = "auto", capacity: int = 256) -> None:
        self.backend = backend
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._programs: OrderedDict[tuple[str, str], Program] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ir_text: str | dict, device: torch.device | str) -> Program:
        """The compiled program of `ir_text`; compiles it on the first request (EtaError if bad)."""
        parsed = parse(ir_text)
        device = torch.device(device)
        key = (parsed.hash, str(device))
        with self._lock:
            program = self._programs.get(key)
            if program is not None:
                self.hits += 1
                self._programs.move_to_end(key)
                return program
        program = _compile(parsed, device, self.backend)
        with self._lock:
            self.misses += 1
            self._programs[key] = program
            while len(self._programs) > self.capacity:
                self._programs.popitem(last=False)
        return program
