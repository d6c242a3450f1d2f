"""chat pieces, tools.equip / tools.answer on SmolLM2, Qwen2.5, Qwen3 (and its thinking-only 2507
variant) and Llama 3.1, against transformers' apply_chat_template on the same tokenizer and template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pie_actors.tokenizer import Tokenizer
from pie_actors.inferlet.chat_ops import ChatTokens
from pie_actors.inferlet.host import HostOpError
from pie_actors.inferlet.tools import ToolFormat
from tests.chat_families import FAMILIES, Family, hf_ids, hf_tokenizer, make_family_dir

SPECS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]


def sys(text):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, default_model_dir, tmp_path_factory):
    """(family, our Tokenizer, ChatTokens, transformers tokenizer) of one family's folder."""
    fam: Family = FAMILIES[request.param]
    folder = make_family_dir(default_model_dir, fam, tmp_path_factory.mktemp(fam.name.replace(".", "_")))
    tok = Tokenizer.from_dir(folder)
    return fam, tok, ChatTokens(tok), hf_tokenizer(folder)


def test_conversations_equal_apply_chat_template(family):
    fam, _, chat, hf = family
    convs = [
        ([sys("You are terse."), user("What is 2+2?")], chat.system("You are terse.") + chat.user("What is 2+2?")),
        ([user("Hi there")], chat.first_user("Hi there")),
        ([sys("Be kind."), user("One"), assistant("Two."), user("Three")],
         chat.system("Be kind.") + chat.user("One") + chat.assistant("Two.") + chat.user("Three")),
        ([user("a"), assistant("b"), user("c"), assistant("d"), user("é ü 日本")],
         chat.first_user("a") + chat.assistant("b") + chat.user("c") + chat.assistant("d")
         + chat.user("é ü 日本")),
        ([sys("S"), user("U")], chat.system_user("S", "U")),
    ]
    for messages, pieces in convs:
        assert pieces + chat.cue() == hf_ids(hf, messages, add_generation_prompt=True), (fam.name, messages)
        assert pieces == hf_ids(hf, messages), (fam.name, messages)


def test_thinking_cues(family):
    fam, tok, chat, hf = family
    messages = [sys("S"), user("U")]
    head = chat.system("S") + chat.user("U")
    text = tok.decode
    if fam.name == "qwen3":          # enable_thinking: the template writes the empty block itself
        assert head + chat.cue_without_thinking() == hf_ids(hf, messages, add_generation_prompt=True,
                                                             enable_thinking=False)
        assert head + chat.cue_thinking(True) == hf_ids(hf, messages, add_generation_prompt=True,
                                                        enable_thinking=True)
        assert text(chat.cue_thinking(True)) == "<|im_start|>assistant\n"
        assert text(chat.system_thinking("S", "none")).endswith("S /no_think<|im_end|>\n")
        assert text(chat.system_thinking("S", "high")).endswith("S /think<|im_end|>\n")
    elif fam.name == "qwen3-thinking":   # the template pre-fills the opening tag
        assert text(chat.cue()) == text(chat.cue_thinking(True)) == "<|im_start|>assistant\n<think>\n"
        assert text(chat.cue_without_thinking()) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    else:                                # no thinking switch: every cue is the generation prompt
        assert chat.cue_without_thinking() == chat.cue_thinking(True) == chat.cue_thinking(False) == chat.cue()
        assert chat.system_thinking("S", "low") == chat.system("S")
    assert chat.cue_thinking(False) == chat.cue_without_thinking()
    with pytest.raises(HostOpError, match="effort"):
        chat.system_thinking("S", "extreme")


def test_reply_then_seal_continues_the_conversation(family):
    """cue + the reply's text + seal is how the template renders the turn once it is over, so
    the next user turn and cue continue it exactly (compared as text: the reply's tokens are the
    model's, not a re-tokenization)."""
    fam, tok, chat, hf = family
    reply = "Four."
    cue = chat.cue_without_thinking()
    tokens = chat.system("S") + chat.user("2+2?") + cue
    rendered_last = hf.apply_chat_template([sys("S"), user("2+2?"), assistant(reply)], tokenize=False)
    assert tok.decode(tokens) + reply + tok.decode(chat.seal()) == rendered_last
    later = [sys("S"), user("2+2?"), assistant(reply), user("And 3+3?")]
    continued = tok.decode(tokens) + reply + tok.decode(chat.seal() + chat.user("And 3+3?") + chat.cue())
    if fam.name in ("qwen3", "qwen3-thinking"):
        # Qwen3 drops the (empty) thinking block of turns before the last question: the KV keeps it
        continued = continued.replace("<think>\n\n</think>\n\n", "", 1)
    assert continued == hf.apply_chat_template(later, tokenize=False, add_generation_prompt=True)
    assert chat.seal()[0] in chat.stop_tokens()


def test_stop_tokens(family):
    fam, tok, chat, _ = family
    names = {tok.id_to_token(t) for t in chat.stop_tokens()}
    # the eos token and the end-of-turn token (the folders have no generation_config.json)
    want = {"llama3.1": {"<|eot_id|>"}}.get(fam.name, {"<|im_end|>"})
    assert names == want


def check_equip_without_template_support(tok, chat, tools) -> None:
    """SmolLM2's template takes no tools: the Hermes instructions go into the system turn."""
    assert tools.family == "hermes"
    text = tok.decode(tools.equip(chat, SPECS, "Be brief."))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.endswith("</tool_call><|im_end|>\n")
    assert json.dumps(SPECS[0]) in text
    # bare function objects are accepted too
    assert tools.equip(chat, [s["function"] for s in SPECS]) == tools.equip(chat, SPECS)
    assert tok.decode(tools.answer(chat, "add", 5)) == (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n")


def test_equip_and_answer_equal_apply_chat_template(family):
    fam, tok, chat, hf = family
    tools = ToolFormat(chat.source)
    if not tools.native:
        check_equip_without_template_support(tok, chat, tools)
        return
    kw = {"tools": SPECS, "tools_in_user_message": False}   # Llama 3.1: tools in the system turn
    for messages, pieces in [
        ([user("Add 2 and 3.")], tools.equip(chat, SPECS) + chat.user("Add 2 and 3.")),
        ([sys("Use tools."), user("Add 2 and 3.")],
         tools.equip(chat, SPECS, "Use tools.") + chat.user("Add 2 and 3.")),
    ]:
        assert pieces + chat.cue() == hf_ids(hf, messages, add_generation_prompt=True, **kw), fam.name
    # the whole loop: question, the model's call, seal, the tool's answer, the next cue
    args = {"a": 2, "b": 3}
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": args}}]}
    messages = [sys("Use tools."), user("Add 2 and 3."), call, {"role": "tool", "name": "add", "content": "5"}]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    if tools.family == "llama3":
        call_text = json.dumps({"name": "add", "parameters": args})
    else:
        call_text = "<tool_call>\n" + json.dumps({"name": "add", "arguments": args}) + "\n</tool_call>"
    if fam.name == "qwen3-thinking":      # its cue opens a thinking block: the model closes it first
        call["reasoning_content"] = "Adding."
        call_text = "Adding.\n</think>\n\n" + call_text
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    head = tools.equip(chat, SPECS, "Use tools.") + chat.user("Add 2 and 3.") + chat.cue()
    tail = chat.seal() + tools.answer(chat, "add", 5) + chat.cue()
    assert tok.decode(head) + call_text + tok.decode(tail) == want
    # a structured result is sent as JSON
    assert tools.answer(chat, "weather", {"t": 21}) == tools.answer(chat, "weather", '{"t": 21}')


@pytest.mark.parametrize("specs", [[], "add", [{"description": "no name"}], [{"name": "f", "parameters": 3}]])
def test_bad_tool_specs_are_clear_errors(default_model_dir, specs):
    chat = ChatTokens(Tokenizer.from_dir(default_model_dir))
    with pytest.raises(ValueError, match="tool spec|parameters"):
        ToolFormat(chat.source).equip(chat, specs)


def test_reasoning_effort_template(default_model_dir, tmp_path: Path):
    """A template with a `reasoning_effort` variable (gpt-oss style) gets the effort itself."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% if m.role == 'system' %}\nReasoning: {{ reasoning_effort | default('medium') }}{% endif %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    folder = make_family_dir(default_model_dir, FAMILIES["smollm2"], tmp_path / "effort", template)
    chat = ChatTokens(Tokenizer.from_dir(folder))
    hf = hf_tokenizer(folder)
    for effort in ("low", "high"):
        assert (chat.system_thinking("S", effort) + chat.user("U")
                == hf_ids(hf, [sys("S"), user("U")], reasoning_effort=effort))
