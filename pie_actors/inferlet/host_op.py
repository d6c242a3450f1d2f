"""Each host operation declared once: `@host_op` on its handler names the op, the shape of its
arguments (a TypedDict) and how they cross the boundary; `bind` checks every call against it.

The guest reaches every op through the WIT's one generic import, `pie:inferlet/host.call(op,
args)`, with JSON args; the glue classes (*_ops.py) group the ops into interfaces (their
`interface`). An op's arguments cross in one of four wire forms:

    none     no arguments: null                                   ws.create
    value    the value of its one field                           ws.fork 3
    list     the values of its fields, in order                   ws.save [3, "notes"]
    object   a JSON object of its fields (NotRequired ones may be left out)   chan.create {...}

`bind` validates the args of each call against the declaration with pydantic, strictly (JSON's
types as they come, no coercion; unknown object fields refused), before the handler runs, and
hands the handler the fields as keyword arguments. A malformed call fails with a HostOpError that
names the field (`lanes.0.tokens: input should be a valid list, got str`; the guest SDK puts the op
before every host error: `eta.submit: lanes.0...`): the guest sees an error result and the run goes on. Checks that need the run's state (is this
handle one of the run's?) stay in the handlers.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from typing import Any, Callable, Literal

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config
from typing_extensions import NotRequired, TypedDict, get_origin, get_type_hints, is_typeddict

from .host import HostOpError

__all__ = ["HostOp", "host_op", "shape", "declared", "bind", "shape_text", "nested_shapes",
           "Handle", "Name", "Text", "Tokens", "HandleTokens"]

Wire = Literal["none", "value", "list", "object"]

shape = with_config(ConfigDict(strict=True, extra="forbid"))
"""Decorates each args TypedDict: strict JSON types, no unknown fields."""


@shape
class Handle(TypedDict):
    handle: int


@shape
class Text(TypedDict):
    text: str


@shape
class Name(TypedDict):
    name: str


@shape
class Tokens(TypedDict):
    tokens: list[int]


@shape
class HandleTokens(TypedDict):
    handle: int
    tokens: list[int]


@dataclasses.dataclass(frozen=True)
class HostOp:
    """One host operation: its name, the TypedDict of its arguments (None: it takes none), their
    wire form, its handler (a glue class's method) and the interface that class serves."""

    name: str
    args: type | None
    wire: Wire
    handler: Callable[..., Any]
    interface: str = ""


def host_op(name: str, args: type | None = None, wire: Wire | None = None) -> Callable:
    """Declare the decorated method the handler of host operation `name`. `wire` defaults to
    "none" without args, "value" for one field, "object" for more ("list" is always said)."""
    if wire is None:
        wire = "none" if args is None else "value" if len(args.__annotations__) == 1 else "object"
    if (wire == "none") != (args is None) or (wire == "value" and len(args.__annotations__) != 1):
        raise TypeError(f"{name}: wire form {wire!r} does not fit its arguments")
    if args is not None and not is_typeddict(args):
        raise TypeError(f"{name}: its arguments are declared as a TypedDict")

    def declare(handler: Callable[..., Any]) -> Callable[..., Any]:
        handler.host_op = HostOp(name, args, wire, handler)
        return handler
    return declare


def declared(glue: type) -> list[HostOp]:
    """The host operations a glue class declares, in the order of its methods."""
    return [dataclasses.replace(fn.host_op, interface=glue.interface)
            for fn in vars(glue).values() if hasattr(fn, "host_op")]


def _got(value: Any) -> str:
    return "null" if value is None else type(value).__name__


@functools.cache          # once an op, not once a run: a TypeAdapter takes ~0.2 ms to build, 64 ops ~12 ms
def _checker(op: HostOp) -> Callable[[Any], dict[str, Any]]:
    """A function from the call's JSON args to the handler's keyword arguments, or HostOpError."""
    if op.args is None:
        def none(raw: Any) -> dict[str, Any]:
            if raw is not None:
                raise HostOpError(f"takes no arguments, got {_got(raw)}")
            return {}
        return none
    adapter, names = TypeAdapter(op.args), list(op.args.__annotations__)

    def check(raw: Any) -> dict[str, Any]:
        if op.wire == "value":
            raw = {names[0]: raw}
        elif op.wire == "list":
            if not isinstance(raw, list) or len(raw) != len(names):
                raise HostOpError(f"takes [{', '.join(names)}], got {_got(raw)}"
                                  + (f" of {len(raw)}" if isinstance(raw, list) else ""))
            raw = dict(zip(names, raw))
        try:
            return adapter.validate_python(raw)
        except ValidationError as e:
            raise HostOpError("; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'arguments'}: "
                f"{err['msg'][0].lower()}{err['msg'][1:]}"
                + ("" if err["type"] == "missing" else f", got {_got(err['input'])}")
                for err in e.errors())) from None
    return check


def bind(op: HostOp, glue: object) -> Callable[[Any], Any]:
    """The op's handler on `glue`, behind the check of its arguments."""
    check, handler = _checker(op), op.handler.__get__(glue)

    def call(raw: Any) -> Any:
        return handler(**check(raw))
    return call


def _type_text(t: Any) -> str:
    if is_typeddict(t):
        return t.__name__
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_text(a) for a in args)
    if origin is Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in args)}]"
    return "any" if t is Any else t.__name__


def _fields_text(args: type) -> str:
    """`name: type` of each field of TypedDict `args`; `name?:` for one that may be left out."""
    hints, marked = get_type_hints(args), get_type_hints(args, include_extras=True)
    return ", ".join(f"{k}{'?' if get_origin(marked[k]) is NotRequired else ''}: {_type_text(t)}"
                     for k, t in hints.items())


def shape_text(op: HostOp) -> str:
    """The op's arguments and result as one line of the table: `[handle: int, name: str] -> int`."""
    fields = _fields_text(op.args) if op.args is not None else ""
    args = {"none": "-", "value": fields, "list": f"[{fields}]", "object": f"{{{fields}}}"}[op.wire]
    result = inspect.signature(op.handler).return_annotation
    return f"{args} -> {'null' if result == 'None' else result}"


def nested_shapes(ops: list[HostOp]) -> dict[str, str]:
    """The objects inside the ops' arguments (a pass's Lane...): name -> `{fields}`."""
    found: dict[str, str] = {}

    def visit(t: Any) -> None:
        if is_typeddict(t) and t.__name__ not in found:
            found[t.__name__] = f"{{{_fields_text(t)}}}"
            for hint in get_type_hints(t).values():
                visit(hint)
        for arg in typing.get_args(t):
            visit(arg)
    for op in ops:
        for hint in get_type_hints(op.args).values() if op.args is not None else ():
            visit(hint)
    return found
