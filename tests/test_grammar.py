"""Grammars and matchers (llguidance behind pie_actors.inferlet.grammar), and constrained greedy
generation with the default model: 20 random JSON schemas whose outputs must validate, and a tool
call through the tool grammar."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from pie_actors.gpu.engine import Lane, PassRequest
from pie_actors.tokenizer import Tokenizer
from pie_actors.inferlet.chat_ops import ChatTokens
from pie_actors.inferlet.grammar import GrammarCompiler, GrammarError, Matcher
from pie_actors.inferlet.tools import ToolCallDecoder, ToolFormat
from tests.chat_families import FAMILIES, make_family_dir
from tests.engine_helpers import make_engine
from tests.test_chat_families import SPECS

ARITHMETIC = """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok, tok.vocab_size, ChatTokens(tok).stop_tokens())


def allowed(matcher: Matcher) -> set[int]:
    words = matcher.mask()
    return {i for i in range(len(words) * 32) if (words[i // 32] >> (i % 32)) & 1}


@pytest.mark.parametrize("make,source,message", [
    ("json_schema", {"type": "objectx"}, "(?s)invalid JSON schema: .*objectx"),
    ("json_schema", "{not json", "invalid JSON schema: not JSON"),
    ("json_schema", 5, "invalid JSON schema: expected an object"),
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "invalid JSON schema"),
    ("regex", "(", "(?s)invalid regex: .*unclosed group"),
    ("regex", "[z-a]", "(?s)invalid regex: .*range"),
    ("ebnf", "start: expr\nexpr: 'a' |", "invalid EBNF grammar"),
    ("ebnf", "root ::= foo (", "invalid EBNF grammar"),
    ("ebnf", "start: undefined_rule", "invalid EBNF grammar"),
])
def test_bad_grammars_are_clear_errors(compiler, make, source, message):
    with pytest.raises(GrammarError, match=message):
        getattr(compiler, make)(source)


def test_mask_accept_reject_terminate(compiler, tok):
    m = Matcher(compiler.regex("(yes|no)!"))
    words = m.mask()
    assert len(words) == tok.vocab_size // 32 and all(type(w) is int and -2**31 <= w < 2**31 for w in words)
    first = allowed(m)
    assert tok.encode("yes")[0] in first and tok.encode("no")[0] in first and tok.encode("maybe")[0] not in first
    stops = set(ChatTokens(tok).stop_tokens())
    assert not first & stops                                   # incomplete: no stop token yet
    # a rejected token changes nothing: same mask, and the matcher goes on
    assert m.accept_tokens(tok.encode("maybe")) is False
    assert m.accept_tokens(tok.encode("yes!")[:1] + tok.encode("x")) is False   # all or nothing
    assert allowed(m) == first
    assert m.accept_tokens(tok.encode("yes")) and not m.is_terminated()
    assert m.accept_tokens(tok.encode("!"))
    assert m.is_terminated() and allowed(m) == stops           # complete: only the stop tokens
    assert m.accept_tokens([tok.encode("a")[0]]) is False
    assert m.accept_tokens([min(stops)]) and allowed(m) == set()   # the stop token ends it
    assert m.accept_tokens([min(stops)]) is False
    m.rollback(2)                                              # the stop token and "!"
    assert not m.is_terminated() and m.accept_tokens(tok.encode("!") + [max(stops)])
    # a stop token only where the grammar is complete; tokens after a stop token never
    a_plus = Matcher(compiler.regex("a+"))
    assert a_plus.accept_tokens([min(stops)]) is False
    assert a_plus.accept_tokens(tok.encode("b") + [min(stops)]) is False
    assert a_plus.accept_tokens(tok.encode("a") + [min(stops)] + tok.encode("a")) is False
    assert a_plus.accept_tokens(tok.encode("aa") + [min(stops)]) and a_plus.is_terminated()


def test_ids_outside_the_vocabulary_are_refused(compiler, tok):
    m = Matcher(compiler.regex("a+"))
    for bad in ([-1], [compiler.vocab_size], [2**40], tok.encode("a") + [-5]):
        assert m.accept_tokens(bad) is False
    assert m.accept_tokens(tok.encode("aa")) and m.accept_tokens(tok.encode("a"))


def test_fork_rollback_reset(compiler, tok):
    m = Matcher(compiler.ebnf(ARITHMETIC))
    assert m.accept_tokens(tok.encode("12+3"))
    before = allowed(m)
    fork = m.fork()
    assert fork.accept_tokens(tok.encode("*(")) and not fork.is_terminated()
    assert allowed(fork) != before and allowed(m) == before   # the fork moved on alone
    assert m.accept_tokens(tok.encode("*("))
    m.rollback(len(tok.encode("*(")))
    assert allowed(m) == before
    with pytest.raises(GrammarError, match=r"only \d+ were accepted"):
        m.rollback(100)
    assert allowed(m) == before                               # still usable
    m.reset()
    assert allowed(m) == allowed(Matcher(compiler.ebnf(ARITHMETIC)))
    assert m.accept_tokens(tok.encode("(1+2)*3"))
    assert Matcher(compiler.ebnf(ARITHMETIC)).accept_tokens(tok.encode("1+*2")) is False


def test_gbnf_json_and_schema_strings(compiler, tok):
    gbnf = compiler.ebnf('root ::= "a" [0-9]+')
    assert Matcher(gbnf).accept_tokens(tok.encode("a42")) and not Matcher(gbnf).accept_tokens(tok.encode("b"))
    for text, ok in [('{"a": [1, 2.5, "x", null, true]}', True), ("[1, 2]", True), ('{"a" 1}', False)]:
        assert Matcher(compiler.any_json()).accept_tokens(tok.encode(text)) is ok, text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert compiler.json_schema(json.dumps(schema)).source == compiler.json_schema(schema).source


def test_tool_grammar_admits_only_valid_calls(default_model_dir, tmp_path):
    for name, good, bad in [
        ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
         '<tool_call>\n{"name": "sub", "arguments": {"a": 2, "b": 3}}\n</tool_call>'),
        ("llama3.1", '{"name": "weather", "parameters": {"city": "Paris"}}',
         '{"name": "weather", "parameters": {}}'),
    ]:
        folder = make_family_dir(default_model_dir, FAMILIES[name], tmp_path / name.replace(".", "_"))
        tok = Tokenizer.from_dir(folder)
        chat = ChatTokens(tok)
        compiler = GrammarCompiler(tok, tok.vocab_size, chat.stop_tokens())
        grammar = compiler.lark(ToolFormat(chat.source).grammar(SPECS, tok))
        m = Matcher(grammar)
        assert m.accept_tokens(tok.encode(good)), name
        assert not Matcher(grammar).accept_tokens(tok.encode(bad)), name


# --- constrained generation with the default model -------------------------------------------

WORDS = ["name", "age", "city", "tags", "score", "id", "color", "size", "items", "ok", "kind", "level"]
MAX_TOKENS = 64


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["enum", "string", "integer", "number", "boolean"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], rng.randint(2, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 10)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 100}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1, "maxItems": 3}
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    keys = rng.sample(WORDS, rng.randint(1, 3 if depth == 0 else 2))
    return {"type": "object", "properties": {k: random_schema(rng, depth) for k in keys}, "required": keys,
            "additionalProperties": False}


def constrained_greedy(engine, prompts: list[list[int]], matchers: list[Matcher], stops: set[int],
                       max_tokens: int) -> tuple[list[list[int]], list[bool]]:
    """Greedy decoding of all prompts in one batch, each step's logits masked by its matcher.
    Returns each sequence's tokens (without the stop token) and whether its grammar finished."""
    vocab = engine.model_config.vocab_size
    shifts = torch.arange(32, dtype=torch.int32)
    seqs = [engine.create_sequence() for _ in prompts]
    inputs, outputs = [list(p) for p in prompts], [[] for _ in prompts]
    done = [False] * len(prompts)
    try:
        for _ in range(max_tokens):
            live = [i for i in range(len(prompts)) if not done[i]]
            if not live:
                break
            futures = {i: engine.submit(PassRequest([Lane(seqs[i], inputs[i])])) for i in live}
            engine.run_until_idle()
            for i, future in futures.items():
                words = torch.from_numpy(matchers[i].mask_array())
                ok = ((words[:, None] >> shifts) & 1).flatten()[:vocab].bool()
                logits = future.result()[-1].float().masked_fill(~ok, float("-inf"))
                token = int(logits.argmax())
                assert matchers[i].accept_tokens([token])
                inputs[i] = [token]
                if token in stops:
                    done[i] = True
                    continue
                outputs[i].append(token)
                done[i] = matchers[i].is_terminated()
    finally:
        for seq in seqs:
            engine.free(seq)
    return outputs, done


@pytest.fixture(scope="module")
def engine(default_model_dir):
    engine = make_engine(default_model_dir, num_pages=512)
    yield engine
    engine.close()


def test_twenty_random_schemas_generate_valid_json(engine, compiler):
    tok = engine.tokenizer
    chat = ChatTokens(tok)
    rng = random.Random(5)
    schemas = [random_object(rng) for _ in range(20)]
    prompts = [chat.system("You reply with JSON only.") + chat.user("Write a JSON value for this schema:\n"
                                                                     + json.dumps(s)) + chat.cue()
               for s in schemas]
    matchers = [Matcher(compiler.json_schema(s)) for s in schemas]
    outputs, done = constrained_greedy(engine, prompts, matchers, set(chat.stop_tokens()), MAX_TOKENS)
    for schema, out, finished in zip(schemas, outputs, done):
        text = tok.decode(out)
        assert finished, (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_tool_call_through_the_tool_grammar(engine, compiler):
    """The default model, constrained by tools.format, writes a call the decoder parses and whose
    arguments validate against the tool's parameters."""
    tok = engine.tokenizer
    chat = ChatTokens(tok)
    tools = ToolFormat(chat.source)
    prompt = tools.equip(chat, SPECS) + chat.user("What is the weather in Paris?") + chat.cue()
    matcher = Matcher(compiler.lark(tools.grammar(SPECS, tok)))
    (out,), _ = constrained_greedy(engine, [prompt], [matcher], set(chat.stop_tokens()), MAX_TOKENS)
    decoder = ToolCallDecoder(tok, tools.family)
    events = [e for t in out for e in decoder.feed([t])]
    calls = [e for e in events if e["type"] == "call"]
    assert events[0] == {"type": "start"} and calls, tok.decode(out)
    spec = {s["function"]["name"]: s["function"]["parameters"] for s in SPECS}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments_json"]), spec[call["name"]])


def test_guest_unpack_mask_matches_the_bits(compiler, tok):
    """inferlet.mask.unpack_mask (pure guest code, loaded here as a plain module) against the
    matcher's packed words, on vocabulary sizes that are and are not multiples of 32."""
    import importlib.util
    from pathlib import Path

    import pie_actors.inferlet as package
    path = Path(package.__file__).parent / "sdk" / "inferlet" / "mask.py"
    spec = importlib.util.spec_from_file_location("guest_mask", path)
    guest_mask = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guest_mask)
    m = Matcher(compiler.any_json())
    words = m.mask()
    assert [i for i, ok in enumerate(guest_mask.unpack_mask(words, tok.vocab_size)) if ok] == sorted(allowed(m))
    rng = random.Random(0)
    for vocab in (1, 31, 32, 33, 1000):
        bits = [rng.random() < 0.5 for _ in range(vocab)]
        packed = [sum(1 << b for b in range(32) if w * 32 + b < vocab and bits[w * 32 + b])
                  for w in range((vocab + 31) // 32)]
        packed = [w - 2**32 if w >= 2**31 else w for w in packed]          # int32 words
        assert guest_mask.unpack_mask(packed, vocab) == bits
    with pytest.raises(ValueError, match="fewer than vocab"):
        guest_mask.unpack_mask(words, tok.vocab_size + 1)
