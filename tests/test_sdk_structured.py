"""chat, grammar, mask, tools and reasoning from inside inferlets: the WebAssembly sandbox, the guest
SDK, InferletHost's host operations and the default model's engine, end to end in one process."""
from __future__ import annotations

import json
import re


from pie_actors.inferlet.chat_ops import ChatTokens
from pie_actors.inferlet.tools import ToolFormat
from tests.inferlet_helpers import run

SPECS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def test_chat_pieces(runtime):
    source = """
from inferlet import chat
async def main(input):
    return {"system_user": chat.system_user("S", "U"), "first_user": chat.first_user("Hi"),
            "thinking": chat.system_thinking("S", "high"), "on": chat.cue_thinking(True),
            "off": chat.cue_thinking(False), "seal": chat.seal(), "seal2": chat.seal()}
"""
    out = run(runtime, source)
    chat = ChatTokens(runtime.engine.tokenizer)
    assert out == {"system_user": chat.system_user("S", "U"), "first_user": chat.first_user("Hi"),
                   "thinking": chat.system("S"), "on": chat.cue(), "off": chat.cue(),
                   "seal": chat.seal(), "seal2": chat.seal()}
    assert runtime.engine.tokenizer.decode(out["seal"]) == "<|im_end|>\n"


def test_matcher_mask_accept_terminate(runtime):
    source = """
from inferlet import model
from inferlet.grammar import Grammar, Matcher
from inferlet.mask import unpack_mask

async def main(input):
    vocab = model.output_vocab_size()
    m = Matcher(Grammar.from_regex("(yes|no)!"))
    allowed = unpack_mask(m.mask(), vocab)
    yes, maybe = model.encode("yes"), model.encode("maybe")
    out = {"words": len(m.mask()), "yes": allowed[yes[0]], "maybe": allowed[maybe[0]],
           "count": sum(allowed), "bad": m.accept_tokens(maybe), "same": unpack_mask(m.mask(), vocab) == allowed}
    fork = m.fork()
    out["good"] = m.accept_tokens(yes)
    out["fork_untouched"] = unpack_mask(fork.mask(), vocab) == allowed
    out["done_early"] = m.is_terminated()
    m.accept_tokens(model.encode("!"))
    out["done"] = m.is_terminated()
    out["after"] = [i for i, ok in enumerate(unpack_mask(m.mask(), vocab)) if ok]
    m.rollback(1)
    out["undone"] = m.is_terminated()
    m.reset()
    out["reset"] = unpack_mask(m.mask(), vocab) == allowed
    e = Matcher(Grammar.from_ebnf('start: "(" NUM ")"\\nNUM: /[0-9]+/'))
    out["ebnf"] = [e.accept_tokens(model.encode("(12")), e.is_terminated(), e.accept_tokens(model.encode(")")),
                   e.is_terminated()]
    j = Matcher(Grammar.json())
    out["json"] = [j.accept_tokens(model.encode('{"a": [1, 2]}')), j.is_terminated()]
    s = Matcher(Grammar.from_json_schema('{"type": "object", "properties": {"n": {"type": "integer"}}}'))
    out["schema"] = s.accept_tokens(model.encode('{"n": "x"}'))
    return out
"""
    out = run(runtime, source)
    stops = set(ChatTokens(runtime.engine.tokenizer).stop_tokens())
    assert out["words"] == 49152 // 32 and out["yes"] and not out["maybe"] and out["count"] >= 2
    assert out["bad"] is False and out["same"] and out["good"] and out["fork_untouched"]
    assert not out["done_early"] and out["done"] and set(out["after"]) == stops
    assert not out["undone"] and out["reset"]
    assert out["ebnf"] == [True, False, True, True] and out["json"] == [True, True] and out["schema"] is False


def test_bad_grammars_and_specs_are_host_errors(runtime):
    source = """
from inferlet import HostError, model, tools
from inferlet.grammar import Grammar, Matcher

async def main(input):
    errors = {}
    for name, make in [("schema", lambda: Grammar.from_json_schema({"type": "objectx"})),
                       ("schema_text", lambda: Grammar.from_json_schema("{nope")),
                       ("regex", lambda: Grammar.from_regex("(")),
                       ("ebnf", lambda: Grammar.from_ebnf("start: a |")),
                       ("specs", lambda: tools.equip([{"description": "no name"}]))]:
        try:
            make()
            errors[name] = None
        except HostError as e:
            errors[name] = str(e)
    errors["still_fine"] = Matcher(Grammar.from_regex("a")).accept_tokens(model.encode("a"))
    return errors
"""
    out = run(runtime, source)
    assert out.pop("still_fine") is True
    want = {"schema": "invalid JSON schema", "schema_text": "not JSON", "regex": "invalid regex",
            "ebnf": "invalid EBNF grammar", "specs": "function name"}
    for name, fragment in want.items():
        assert out[name] and fragment in out[name], (name, out[name])
        _, message = out[name].split(": ", 1)        # HostError: "<operation>: <the host's message>"
        assert not re.match(r"\w+Error:", message), out[name]     # no Python type name in front


def test_greedy_with_a_grammar_fallback(runtime):
    """The argmax epilogue picks each token; where the grammar refuses it, the inferlet takes the
    first token the mask allows. The answer must be one of the enum's values."""
    source = """
from inferlet import chat, model
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax
from inferlet.grammar import Grammar, Matcher
from inferlet.mask import unpack_mask

async def main(input):
    m = Matcher(Grammar.from_json_schema({"enum": ["Paris", "London", "Berlin"]}))
    vocab = model.output_vocab_size()
    tokens = chat.system("Answer in JSON.") + chat.user("What is the capital of France?") + chat.cue()
    ws, pipe, out, forced = WorkingSet(), Pipeline(), [], 0
    while not m.is_terminated() and len(out) < 16:
        fwd = ForwardPass()
        fwd.embed(tokens)
        fwd.state([ws], StateGeometry.folding())
        nxt = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        token = await nxt
        if not m.accept_tokens([token]):
            token = unpack_mask(m.mask(), vocab).index(True)
            forced += 1
            assert m.accept_tokens([token])
        out.append(token)
        tokens = [token]
    pipe.close()
    return {"text": model.decode(out), "done": m.is_terminated(), "forced": forced}
"""
    out = run(runtime, source)
    print(f"\nenum answer {out['text']!r}, {out['forced']} token(s) forced by the mask")
    assert out["done"] and json.loads(out["text"]) in ("Paris", "London", "Berlin"), out


def test_tools_in_the_sandbox(runtime):
    source = """
import json
from inferlet import chat, model, tools

async def main(input):
    specs = input["specs"]
    out = {"equip": tools.equip(specs, "Use tools."), "answer": tools.answer("add", {"sum": 5})}
    call = '<tool_call>\\n{"name": "add", "arguments": {"a": 2, "b": 3}}\\n</tool_call>'
    bad = '<tool_call>\\n{"name": "add", "arguments": {"a": 2,}}\\n</tool_call>'
    events = []
    decoder = tools.Decoder()
    for t in model.encode("Let me add. " + call + bad + "<tool_call>{"):
        e = decoder.feed([t])
        if not isinstance(e, tools.Event.Idle):
            events.append(e)
    events.append(decoder.finish())
    out["events"] = [[type(e).__name__] + ([e.call.name, e.call.arguments] if isinstance(e, tools.Event.Call)
                     else [e.message] if isinstance(e, tools.Event.Error) else []) for e in events]
    chunked = tools.Decoder()
    out["chunked"] = [type(chunked.feed(model.encode(call))).__name__, type(chunked.feed([])).__name__,
                      type(chunked.feed([])).__name__]
    m = tools.create_matcher(specs)
    out["valid"] = m.accept_tokens(model.encode(call))
    out["invalid"] = tools.create_matcher(specs).accept_tokens(model.encode(call.replace("add", "mul")))
    return out
"""
    out = run(runtime, source, {"specs": SPECS})
    tok = runtime.engine.tokenizer
    chat = ChatTokens(tok)
    tools = ToolFormat(chat.source)
    assert out["equip"] == tools.equip(chat, SPECS, "Use tools.")
    assert tok.decode(out["answer"]) == (
        '<|im_start|>user\n<tool_response>\n{"sum": 5}\n</tool_response><|im_end|>\n')
    kinds = [e[0] for e in out["events"]]
    assert kinds == ["Start", "Call", "Start", "Error", "Start", "Error"], out["events"]
    assert out["events"][1] == ["Call", "add", {"a": 2, "b": 3}]
    assert "not valid JSON" in out["events"][3][1] and "ended inside a tool call" in out["events"][5][1]
    assert out["chunked"] == ["Start", "Call", "Idle"]
    assert out["valid"] is True and out["invalid"] is False


def test_reasoning_in_the_sandbox(runtime):
    source = """
from inferlet import chat, model, reasoning

async def main(input):
    reply = model.encode("<think>Two and two.</think>Four.")
    decoder = reasoning.Decoder.for_cue(chat.cue())
    stepwise = []
    for t in reply:
        e = decoder.feed([t])
        stepwise.append([type(e).__name__, getattr(e, "text", None)])
    chunk = reasoning.Decoder.for_cue(chat.cue())
    drained = [chunk.feed(reply)] + [chunk.feed([]) for _ in range(3)]
    prefilled = reasoning.Decoder.for_cue(chat.cue() + model.encode("<think>\\n"))
    first = prefilled.feed(model.encode("Hmm"))
    return {"stepwise": stepwise, "drained": [[type(e).__name__, getattr(e, "text", None)] for e in drained],
            "prefilled": [type(first).__name__, type(prefilled.feed([])).__name__]}
"""
    out = run(runtime, source)
    kinds = [k for k, _ in out["stepwise"]]
    assert kinds[kinds.index("Start") + 1:kinds.index("End")].count("Delta") >= 1
    deltas = "".join(text for k, text in out["stepwise"] if k == "Delta")
    assert deltas == "Two and two." and ["End", "Two and two."] in out["stepwise"]
    assert kinds[-1] == "Idle"                      # the answer's tokens
    assert out["drained"] == [["Start", None], ["Delta", "Two and two."], ["End", "Two and two."], ["Idle", None]]
    assert out["prefilled"] == ["Start", "Delta"]


def test_bad_token_ids_from_the_guest(runtime):
    """Ids outside the vocabulary: a matcher refuses them, a decoder says so, and both go on."""
    source = """
from inferlet import HostError, model, reasoning, tools
from inferlet.grammar import Grammar, Matcher

async def main(input):
    m = Matcher(Grammar.from_regex("a+"))
    out = {"refused": [m.accept_tokens([-1]), m.accept_tokens([model.output_vocab_size()])],
           "then": m.accept_tokens(model.encode("aa"))}
    call = model.encode('<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
    for name, decoder in [("tools", tools.Decoder()), ("reasoning", reasoning.Decoder.for_cue([]))]:
        try:
            decoder.feed([-1])
            out[name] = None
        except HostError as e:
            out[name] = str(e)
    decoder = tools.Decoder()
    try:
        decoder.feed(call[:3] + [10**12])
    except HostError:
        pass
    out["after"] = [type(decoder.feed(call)).__name__, type(decoder.feed([])).__name__]
    return out
"""
    out = run(runtime, source)
    assert out["refused"] == [False, False] and out["then"] is True
    assert "tools.feed: token id -1 out of range" in out["tools"]
    assert "reasoning.feed: token id -1 out of range" in out["reasoning"]
    assert out["after"] == ["Start", "Call"]
