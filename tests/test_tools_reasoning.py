"""The streaming decoders (tool calls, thinking blocks): every split of a token stream gives the
same events, with tags as single added tokens (Qwen, Llama) and as several ordinary tokens (SmolLM2)."""
from __future__ import annotations

import json
import random

import pytest

from pie_actors.tokenizer import Tokenizer
from pie_actors.inferlet.chat_ops import ChatTokens
from pie_actors.inferlet.reasoning import ReasoningDecoder
from pie_actors.inferlet.textstream import TextStream
from pie_actors.inferlet.tools import ToolCallDecoder
from tests.chat_families import FAMILIES, make_family_dir

HERMES_REPLIES = {
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>':
        [("start",), ("call", "add", {"a": 2, "b": 3})],
    'Sure, I <tool use tools: <tool_call>\n{"name": "weather", "arguments": {"city": "Zürich 日本"}}\n'
    '</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>':
        [("start",), ("call", "weather", {"city": "Zürich 日本"}), ("start",), ("call", "add", {"a": 1})],
    '<tool_call>\n{"name": "add", "arguments": {"a": 2,}\n</tool_call>': [("start",), ("error", "not valid JSON")],
    '<tool_call>\n["add", 2]\n</tool_call>': [("start",), ("error", "no function name")],
    '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>':
        [("start",), ("error", "not a JSON object")],
    "No call here, just </tool_call> and <tool_": [],
}

LLAMA_REPLIES = {
    '{"name": "add", "parameters": {"a": 2, "b": 3}}': [("start",), ("call", "add", {"a": 2, "b": 3})],
    '<|python_tag|>{"name": "weather", "parameters": {"city": "}{\\"[]"}}':
        [("start",), ("call", "weather", {"city": '}{"[]'})],
    '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}':
        [("start",), ("call", "add", {"a": 1}), ("start",), ("call", "add", {"a": 2})],
    '  {"name": "add", "parameters": {"a": 1,}}': [("start",), ("error", "not valid JSON")],
    "The answer is {5}.": [],
}

REASONING_REPLIES = [
    "<think>\nLet me see: 2+2 is 4, not </thin or <think>.\n</think>\n\nThe answer is 4.",
    "  <think>日本語 🤖 and é</think>ok",
    "No thinking here <think>fake</think>",
    "<think>never closed, ends with </thi",
    "<think></think>empty",
]


@pytest.fixture(scope="module")
def tokenizers(default_model_dir, tmp_path_factory):
    """name -> Tokenizer: SmolLM2 (tags are several tokens), Qwen3 and Llama 3.1 (added tokens)."""
    out = {"smollm2": Tokenizer.from_dir(default_model_dir)}
    for name in ("qwen3", "llama3.1", "qwen3-thinking"):
        folder = tmp_path_factory.mktemp(name.replace(".", "_"))
        out[name] = Tokenizer.from_dir(make_family_dir(default_model_dir, FAMILIES[name], folder))
    return out


def splits(n: int, seed: int = 0):
    """Ways to cut a stream of n tokens into feeds: all at once, one by one, at every single
    boundary, and random chunks (some empty)."""
    yield [n]
    yield [1] * n
    for i in range(n + 1):
        yield [i, n - i]
    rng = random.Random(seed)
    for _ in range(20):
        sizes, left = [], n
        while left:
            k = min(left, rng.choice([0, 1, 2, 3, 5, 8]))
            sizes.append(k)
            left -= k
        yield sizes


def run(decoder, tokens: list[int], sizes: list[int]) -> list[dict]:
    events, at = [], 0
    for k in sizes:
        events += decoder.feed(tokens[at:at + k])
        at += k
    return events


def merged(events: list[dict]) -> list[tuple]:
    """Events with consecutive deltas joined (their split depends on the feeds; nothing else may)."""
    out: list[tuple] = []
    for e in events:
        if e["type"] == "delta" and out and out[-1][0] == "delta":
            out[-1] = ("delta", out[-1][1] + e["text"])
        else:
            out.append((e["type"],) + tuple(e[k] for k in ("text", "name", "arguments_json", "message") if k in e))
    return out


def summary(events: list[dict]) -> list[tuple]:
    out = []
    for e in events:
        if e["type"] == "call":
            out.append(("call", e["name"], json.loads(e["arguments_json"])))
        elif e["type"] == "error":
            out.append(("error", e["message"]))
        else:
            out.append((e["type"],))
    return out


@pytest.mark.parametrize("name,family,replies", [
    ("smollm2", "hermes", HERMES_REPLIES), ("qwen3", "hermes", HERMES_REPLIES),
    ("llama3.1", "llama3", LLAMA_REPLIES), ("smollm2", "llama3", LLAMA_REPLIES),
])
def test_tool_decoder_same_calls_at_every_split(tokenizers, name, family, replies):
    tok = tokenizers[name]
    for text, want in replies.items():
        tokens = tok.encode(text)
        first = run(ToolCallDecoder(tok, family), tokens, [len(tokens)])
        got = summary(first)
        assert len(got) == len(want) and all(
            g[0] == w[0] and (w[1] in g[1] if g[0] == "error" else g == w) for g, w in zip(got, want)), (text, got)
        for sizes in splits(len(tokens)):
            assert run(ToolCallDecoder(tok, family), tokens, sizes) == first, (text, sizes)


def test_tool_decoder_errors_carry_the_text_and_finish_reports_an_open_call(tokenizers):
    tok = tokenizers["qwen3"]
    bad = '{"name": "add", "arguments": {"a": 2,}'
    events = ToolCallDecoder(tok, "hermes").feed(tok.encode(f"<tool_call>\n{bad}\n</tool_call>"))
    assert events[1]["type"] == "error" and events[1]["text"] == bad
    decoder = ToolCallDecoder(tok, "hermes")
    assert decoder.feed(tok.encode('<tool_call>\n{"name": "add"')) == [{"type": "start"}]
    (error,) = decoder.finish()
    assert error["type"] == "error" and "ended inside a tool call" in error["message"]
    assert error["text"] == '\n{"name": "add"'
    assert decoder.finish() == []
    decoder = ToolCallDecoder(tok, "hermes")      # a call ended by its tag is not open
    decoder.feed(tok.encode('<tool_call>{"name": "f"}</tool_call>'))
    assert decoder.finish() == []


@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_reasoning_decoder_same_events_at_every_split(tokenizers, name):
    tok = tokenizers[name]
    for text in REASONING_REPLIES:
        tokens = tok.encode(text)
        first = merged(run(ReasoningDecoder(tok), tokens, [len(tokens)]))
        for sizes in splits(len(tokens)):
            events = run(ReasoningDecoder(tok), tokens, sizes)
            assert merged(events) == first, (text, sizes)
            deltas = "".join(e["text"] for e in events if e["type"] == "delta")
            ends = [e["text"] for e in events if e["type"] == "end"]
            assert all(end == deltas for end in ends)           # End carries all the thinking
        kinds = [e[0] for e in first]
        if text.lstrip().startswith("<think>"):
            assert kinds[0] == "start"
        else:
            assert first == []
    tokens = tok.encode(REASONING_REPLIES[0])
    assert merged(run(ReasoningDecoder(tok), tokens, [len(tokens)])) == [
        ("start",), ("delta", "\nLet me see: 2+2 is 4, not </thin or <think>.\n"),
        ("end", "\nLet me see: 2+2 is 4, not </thin or <think>.\n")]


def test_reasoning_decoder_for_cues(tokenizers):
    """A cue that pre-fills <think> starts the reply inside the block (Start comes with the first
    feed); one that holds an empty block means no thinking; a plain cue waits for <think>."""
    tok = tokenizers["qwen3-thinking"]
    chat = ChatTokens(tok)
    reply = tok.encode("Two and two.\n</think>\n\n4")
    for sizes in splits(len(reply)):
        events = run(ReasoningDecoder.for_cue(tok, chat.cue()), reply, sizes)
        assert merged(events) == [("start",), ("delta", "Two and two.\n"), ("end", "Two and two.\n")]
    assert run(ReasoningDecoder.for_cue(tok, chat.cue_without_thinking()),
               tok.encode("<think>x</think>4"), [1] * 6) == []
    qwen3 = ChatTokens(tokenizers["qwen3"])
    thinking = tok.encode("<think>a</think>b")
    assert merged(ReasoningDecoder.for_cue(tok, qwen3.cue()).feed(thinking)) == [
        ("start",), ("delta", "a"), ("end", "a")]
    assert ReasoningDecoder.for_cue(tok, qwen3.cue_without_thinking()).feed(thinking) == []


def test_text_stream_holds_back_split_characters(tokenizers):
    tok = tokenizers["smollm2"]
    text = "a 🤖 b 日本 é"
    tokens = tok.encode(text)
    stream = TextStream(tok)
    pieces = [stream.feed([t]) for t in tokens]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(tokens) > len(text.split())          # some characters really are split


def test_decoders_refuse_ids_outside_the_vocabulary_and_go_on(tokenizers):
    tok = tokenizers["smollm2"]
    call = tok.encode('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>')
    tools, thinking = ToolCallDecoder(tok, "hermes"), ReasoningDecoder(tok, opened=True)
    for bad in ([-1], [tok.vocab_size], call[:2] + [2**40]):
        for decoder in (tools, thinking):
            with pytest.raises(ValueError, match="out of range"):
                decoder.feed(bad)
    assert tools.feed(call) == [{"type": "start"}, {"type": "call", "name": "a", "arguments_json": "{}"}]
    assert thinking.feed(tok.encode("x</think>")) == [{"type": "start"}, {"type": "delta", "text": "x"},
                                                     {"type": "end", "text": "x"}]
