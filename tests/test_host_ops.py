"""Every host operation's declaration (host_op.py) against real runs: each declared op fed a missing
field, a wrong type and, where it takes a handle, a handle the run never made, gets an error result
that names the op and the field; the run goes on, its neighbour's greedy tokens are the engine's,
and the KV pages return. The guest SDK calls exactly the declared ops; ops.py's table is theirs."""
from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, Literal

from typing_extensions import get_type_hints, is_typeddict

import pie_actors.inferlet.ops as ops_module
from pie_actors.inferlet.chat_ops import ChatTokens
from pie_actors.inferlet.host_op import HostOp
from pie_actors.inferlet.ops import host_ops, op_table_text
from tests.inferlet_helpers import EXAMPLES, referenced, settle

SDK = Path(ops_module.__file__).parent / "sdk" / "inferlet"
PROMPT = "The capital of France is"
COMPLETION_TOKENS = (EXAMPLES / "completion" / "main.py").read_text().replace(
    'return {"text": model.decode(tokens[-8:])}', 'return {"tokens": tokens[-8:]}')

# each case's call, its error caught; then the run goes on to a greedy completion of its own
MALFORMED = COMPLETION_TOKENS.replace("async def main(input: dict) -> dict:\n", '''async def main(input: dict) -> dict:
    from inferlet import _host, HostError
    errors = {}
    for case, op, args in input["cases"]:
        try:
            _host.call(op, args)
            errors[case] = None
        except HostError as e:
            errors[case] = str(e)
    out = await greedy(input)
    return {"errors": errors, "tokens": out["tokens"]}


async def greedy(input: dict) -> dict:
''')
NEVER_MADE = 999          # a handle no run here makes


def sample(t: Any) -> Any:
    """A JSON value of type `t`."""
    if is_typeddict(t):
        return {k: sample(v) for k, v in get_type_hints(t).items() if k in t.__required_keys__ or k == "ws"}
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Literal:
        return args[0]
    if origin in (typing.Union, type(int | None)):
        return sample(args[0])
    if origin in (list, tuple):
        return [sample(a) for a in args] if origin is tuple else [sample(args[0])]
    if origin is dict:
        return {"a": sample(args[1])}
    return {int: 1, str: "a", bool: True, float: 1.0}.get(t)


def wire(op: HostOp, fields: dict[str, Any]) -> Any:
    """`fields` in the op's wire form."""
    return {"value": lambda: next(iter(fields.values())), "list": lambda: list(fields.values()),
            "object": lambda: fields}[op.wire]()


def cases() -> list[tuple[str, str, Any, str]]:
    """(case, op, args, what the error must say) for every declared op."""
    out = []
    for op in host_ops():
        if op.args is None:
            out.append((f"{op.name} args", op.name, [1], f"{op.name}: takes no arguments"))
            continue
        hints = get_type_hints(op.args)
        fields = {k: sample(v) for k, v in hints.items()}
        first = next(iter(hints))
        missing = {k: v for k, v in fields.items() if k != first}
        said = {"value": f"{op.name}: {first}", "object": f"{op.name}: {first}: field required",
                "list": f"{op.name}: takes [{', '.join(hints)}]"}[op.wire]
        out.append((f"{op.name} missing", op.name, None if op.wire == "value" else wire(op, missing), said))
        typed = next((k for k, v in hints.items() if v is not Any), None)
        if typed is not None:      # a field of some type: a value of another
            wrong = {**fields, typed: 5 if sample(hints[typed]) == "a" else "x"}
            out.append((f"{op.name} type", op.name, wire(op, wrong), f"{op.name}: {typed}"))
        if "handle" in hints:
            out.append((f"{op.name} handle", op.name, wire(op, {**fields, "handle": NEVER_MADE}), str(NEVER_MADE)))
    lane = {"ws": NEVER_MADE, "tokens": [1]}
    out += [("eta.submit lane tokens", "eta.submit", {"lanes": [{"ws": 1, "tokens": "ab"}]},
             "eta.submit: lanes.0.tokens: input should be a valid list, got str"),
            ("eta.submit lane field", "eta.submit", {"lanes": [{**lane, "colour": 1}]}, "eta.submit: lanes.0.colour:"),
            ("eta.submit no lane", "eta.submit", {"lanes": []}, "eta.submit: lanes: list should have at least 1"),
            ("eta.submit lane handle", "eta.submit", {"lanes": [lane]}, f"unknown working set {NEVER_MADE}"),
            ("eta.run_ahead lane handle", "eta.run_ahead", {"lanes": [lane], "budget": 1, "window": 1},
             f"unknown working set {NEVER_MADE}")]
    return out


def test_every_op_refuses_malformed_args_and_the_runs_go_on(runtime):
    engine, tok = runtime.engine, runtime.engine.tokenizer
    want = engine.generate([ChatTokens(tok).prefix() + tok.encode(PROMPT)], 8, ignore_eos=True)[0]
    start = referenced(runtime)
    table = cases()
    bad = runtime.launch(MALFORMED, {"prompt": PROMPT, "cases": [[c, op, args] for c, op, args, _ in table]})
    good = runtime.launch(COMPLETION_TOKENS, {"prompt": PROMPT})
    out = bad.result()
    assert good.result()["tokens"] == want          # the neighbour is untouched
    assert out["tokens"] == want                     # and the run itself goes on, whole
    for case, op, _, said in table:
        error = out["errors"][case]
        assert error is not None and error.startswith(f"{op}: ") and said in error, (case, error)
        assert not error.startswith(f"{op}: {op}: "), error          # the op named once
    assert {op.name for op in host_ops()} <= {op for _, op, _, _ in table}
    settle(runtime, start)


def sdk_ops() -> set[str]:
    """The op names the guest SDK calls."""
    text = "\n".join(p.read_text() for p in SDK.glob("*.py"))
    names = set(re.findall(r'_host\.call(?:_async)?\(\s*"(\w+\.\w+)"', text))
    names |= {f"chat.{kind}" for kind in re.findall(r'_piece\("(\w+)"', text)}
    return names


def test_the_sdk_calls_exactly_the_declared_ops():
    # chan.free: the Python SDK's channels live as long as the run (the engine frees them with it)
    assert sdk_ops() == {op.name for op in host_ops()} - {"chan.free"}


def test_the_ops_table_is_the_declarations():
    assert op_table_text() in ops_module.__doc__
