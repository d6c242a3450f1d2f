"""The SDK examples (examples/constrained_json, constrained_ebnf, tool_agent, reasoning_chat,
interactive_chat) run as inferlets against the default model: the sandbox, the guest SDK, the host
and the engine, end to end. Their outputs are checked for structure (valid JSON, a parsable
expression, a parsed and answered tool call, thinking kept apart from the answer, a chat that
reuses its working set), not for what a 135M model knows."""
from __future__ import annotations

import ast
import json
from fractions import Fraction
from pathlib import Path

import jsonschema
import pytest

from pie_actors.inferlet.chat_ops import ChatTokens
from tests.chat_families import thinking_model_dir
from pie_actors import Runtime
from tests.inferlet_helpers import referenced, run, settle

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> str:
    return (EXAMPLES / name / "main.py").read_text()


def literal(name: str, constant: str):
    """The value of a module-level constant of an example (examples import the guest SDK, so they
    cannot be imported here)."""
    for node in ast.parse(example(name)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == constant for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(constant)


# ---- constrained decoding -----------------------------------------------------------------------

SCHEMAS = {
    "default": None,
    "nested": {"type": "object", "additionalProperties": False, "required": ["title", "tags", "meta"],
               "properties": {"title": {"type": "string", "maxLength": 16},
                              "tags": {"type": "array", "items": {"enum": ["news", "sport", "art"]},
                                       "minItems": 1, "maxItems": 3},
                              "meta": {"type": "object", "additionalProperties": False, "required": ["year"],
                                       "properties": {"year": {"type": "integer", "minimum": 1900,
                                                               "maximum": 2100}}}}},
    "numbers": {"type": "array", "items": {"type": "number", "minimum": -10, "maximum": 10},
                "minItems": 2, "maxItems": 4},
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_constrained_json_validates(runtime, name):
    engine = runtime.engine
    start = referenced(runtime)
    schema = SCHEMAS[name]
    out = run(runtime, example("constrained_json"), {} if schema is None else {"schema": schema})
    schema = schema or literal("constrained_json", "PERSON")
    assert out["complete"], out
    assert json.loads(out["text"]) == out["value"]
    jsonschema.validate(out["value"], schema)
    settle(runtime, start)


def parse_arithmetic(text: str) -> Fraction | None:
    """Check `text` against the example's ARITHMETIC grammar (recursive descent) and evaluate it;
    None when it divides by zero. A ValueError says where it does not match."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def number() -> Fraction:
        nonlocal pos
        end = pos
        while end < len(text) and text[end].isdigit():
            end += 1
        if not 1 <= end - pos <= 6:
            raise ValueError(f"a number of 1 to 6 digits expected at {pos}: {text!r}")
        value, pos = Fraction(int(text[pos:end])), end
        return value

    def factor():
        nonlocal pos
        if peek() == "(":
            pos += 1
            value = expr()
            if peek() != ")":
                raise ValueError(f"')' expected at {pos}: {text!r}")
            pos += 1
            return value
        return number()

    def chain(operand, ops):
        nonlocal pos
        value = operand()
        while peek() in ops and peek():
            op = peek()
            pos += 1
            right = operand()
            if value is None or right is None:
                value = None
            elif op == "+":
                value += right
            elif op == "-":
                value -= right
            elif op == "*":
                value *= right
            else:
                value = None if right == 0 else value / right
        return value

    def term():
        return chain(factor, "*/")

    def expr():
        return chain(term, "+-")

    value = expr()
    if pos != len(text):
        raise ValueError(f"unexpected {text[pos:]!r} at {pos}: {text!r}")
    return value


def test_parse_arithmetic_checks_the_grammar():
    assert parse_arithmetic("(1+2)*3-4/2") == 7 and parse_arithmetic("7/0") is None
    for bad in ("", "1+", "(1", "1 + 2", "1234567", "2**3", "-1"):
        with pytest.raises(ValueError):
            parse_arithmetic(bad)


@pytest.mark.parametrize("prompt", [None, "What is seven times six plus one?"])
def test_constrained_ebnf_output_is_an_expression(runtime, prompt):
    out = run(runtime, example("constrained_ebnf"), {} if prompt is None else {"prompt": prompt})
    assert out["complete"] and out["tokens"] >= 1, out
    parse_arithmetic(out["text"])


def test_constrained_ebnf_ends_complete_within_a_small_budget(runtime):
    """A budget too small for the model's own expression: the last tokens only let it finish."""
    out = run(runtime, example("constrained_ebnf"), {"max_tokens": 6, "close_within": 4})
    assert out["complete"] and out["tokens"] <= 6, out
    parse_arithmetic(out["text"])


@pytest.mark.parametrize("name, input, message", [
    ("constrained_json", {"schema": {"type": "objectx"}}, "invalid JSON schema"),
    ("constrained_json", {"schema": {"type": "string", "pattern": "(("}}, "unclosed group"),
    ("constrained_ebnf", {"grammar": "start: expr\nexpr: NUM |"}, "invalid EBNF grammar"),
    ("constrained_ebnf", {"grammar": "root ::= \"a"}, "invalid EBNF grammar"),
])
def test_bad_grammars_are_reported_by_the_examples(runtime, name, input, message):
    out = run(runtime, example(name), input)
    assert set(out) == {"error"} and message in out["error"], out


# ---- tools ------------------------------------------------------------------------------------------

def test_tool_agent_calls_the_calculator_and_gets_the_answer_back(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    out = run(runtime, example("tool_agent"), {"question": "What is 37 times 12?"})
    assert out["errors"] == [] and len(out["calls"]) == 1, out
    call = out["calls"][0]
    assert call["name"] == "calculator"
    jsonschema.validate(call["arguments"], literal("tool_agent", "CALCULATOR")["function"]["parameters"])
    a, op, b = call["arguments"]["a"], call["arguments"]["op"], call["arguments"]["b"]
    want = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
    assert call["result"] == ({"result": want} if want is not None else {"error": "division by zero"})
    # the call, then the result as the model's family writes it, then the model's next reply
    chat = ChatTokens(engine.tokenizer)
    answer_turn = engine.tokenizer.decode(chat.seal() + chat.user(
        f"<tool_response>\n{json.dumps(call['result'])}\n</tool_response>") + chat.cue())
    transcript = out["transcript"]
    assert out["rounds"] == 2 and transcript.endswith(answer_turn + out["answer"]), transcript[-300:]
    assert transcript.index('"name": "calculator"') < transcript.index("<tool_response>")
    settle(runtime, start)


def test_tool_agent_reports_a_call_cut_off(runtime):
    """Too few tokens for the call: the decoder reports the open call at the end of the reply as an
    error event; nothing is answered and the inferlet ends normally."""
    out = run(runtime, example("tool_agent"), {"max_tokens": 8})
    assert out["calls"] == [] and out["rounds"] == 1, out
    assert len(out["errors"]) == 1 and "ended inside a tool call" in out["errors"][0]["message"]


# ---- reasoning --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking_served(default_model_dir, tmp_path_factory):
    """A local runtime on `thinking_model_dir`: replies open with thinking."""
    folder = thinking_model_dir(default_model_dir, tmp_path_factory.mktemp("qwen3_thinking"))
    with Runtime.local(str(folder), dtype="float32", num_pages=256, timeout_s=120, compile="off") as rt:
        yield rt


@pytest.mark.parametrize("budget", [8, 200])
def test_reasoning_chat_separates_thinking_on_a_thinking_template(thinking_served, budget):
    engine = thinking_served.engine
    assert engine.tokenizer.decode(ChatTokens(engine.tokenizer).cue()).endswith("<think>\n")
    sent: list[str] = []
    out = run(thinking_served, example("reasoning_chat"), {"think_budget": budget, "max_tokens": 24},
              on_send=sent.append)
    assert out["events"] == ["Start", "Delta", "End"], out
    assert out["thinking"] and out["answer"], out
    assert "".join(json.loads(m)["thinking"] for m in sent).strip() == out["thinking"]
    assert not any(tag in out["thinking"] + out["answer"] for tag in ("<think>", "</think>"))
    if budget == 8:          # closed by the inferlet, and no longer than the budget allows
        assert out["forced_close"] and len(engine.tokenizer.encode(out["thinking"])) <= 8


def test_reasoning_chat_on_a_model_without_thinking(runtime):
    """SmolLM2's template has no thinking: cue_thinking(True) is the plain cue, the decoder stays
    idle and the whole reply is the answer."""
    out = run(runtime, example("reasoning_chat"), {"max_tokens": 16})
    assert out["thinking"] is None and out["events"] == [] and not out["forced_close"]
    assert out["answer"], out


# ---- interactive chat ---------------------------------------------------------------------------

def test_interactive_chat_reuses_its_working_set_and_matches_a_fresh_request(runtime):
    engine = runtime.engine
    chat = ChatTokens(engine.tokenizer)
    start = referenced(runtime)
    first, second = "What is the capital of France?", "And of Italy?"
    sent: list[str] = []
    out = run(runtime, example("interactive_chat"), {}, messages=[first, second, None],
              on_send=sent.append)
    t1, t2 = out["turns"]
    assert [json.loads(m) for m in sent] == [{"turn": 1, **t1}, {"turn": 2, **t2}]
    assert t1["reply"] and t2["reply"]
    # turn 2 found turn 1 in the working set and fed only the end of the reply and the new turn
    assert t1["folded_before"] == 0 and t2["folded_before"] == t1["folded_after"] > t1["fed"]
    assert t2["fed"] == len(chat.seal() + chat.user(second) + chat.cue_without_thinking())
    settle(runtime, start)

    # a fresh request given the whole conversation: the same tokens, the same greedy reply; the
    # pages the chat left in the prefix cache are found again
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": t1["reply"]}]
    fresh = run(runtime, example("interactive_chat"), {"history": history, "turns": 1},
                messages=[second])
    (f2,) = fresh["turns"]
    assert f2["fed"] == t2["folded_before"] + t2["fed"] and f2["folded_after"] == t2["folded_after"]
    assert f2["reply"] == t2["reply"]
    assert f2["cached_tokens"] >= engine.kv.page_size, f2
    settle(runtime, start)
