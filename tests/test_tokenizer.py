"""Tokenizer and chat templates, against transformers (its own GGUF tokenizer converter and renderer)."""
from __future__ import annotations

import json

import pytest

from pie_actors.chat_template import ChatTemplate, TemplateError
from pie_actors.gpu.model.loader import import_gguf
from pie_actors.tokenizer import Tokenizer, tokenizer_from_gguf

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\n\r\n\n",
    "12345 + 678 = 999, 3.14159e-10, 1,000,000",
    "naïve café résumé Ünïcödé",
    "日本語のテキストと한국어",
    "emoji 🤖🚀👍🏽 mix",
    "def f(x):\n    return x**2  # square\n\n\tpass",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_start|><|im_end|>",
    "<|im_start |> is not special, <im_start> neither",
    "I'm sure they'll say we've done it, can't you?",
    "ALLCAPS and MiXeD CaSe",
    "   \n\n   \t ",
    "",
    "a" * 60,
    "https://example.com/path?q=1&r=2#frag",
    "\u200b zero\u00a0width and nbsp",
    "e\u0301 combining accent vs é",
    "x=1;y=22;z=333;w=4444\u2028",
    '{"json": [1, 2, {"k": null}]}',
    "Ελληνικά и русский текст",
]


@pytest.fixture(scope="module")
def ours(default_model_dir):
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def reference(default_gguf):
    """transformers' tokenizer, built by its own GGUF converter straight from the GGUF file."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


def test_encode_equals_transformers_gguf_tokenizer(ours, reference):
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text


def test_decode_round_trips_and_equals_transformers(ours, reference):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special=True) == reference.decode(ids, skip_special_tokens=True)


def test_default_tokenizer_facts(ours):
    # transformers' converter gives SmolLM the plain GPT-2 split, ours adds SmolLM's per-digit split;
    # they agree (above) because the vocabulary has no multi-digit tokens. Digits must stay single:
    assert [ours.id_to_token(i) for i in ours.encode(" 2024")] == ["Ġ", "2", "0", "2", "4"]
    assert [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str("x 2024")] == ["x", "Ġ", "2", "0", "2", "4"]
    assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert ours.vocab_size == 49152
    assert (ours.bos_token, ours.bos_id) == ("<|im_start|>", 1)
    assert ours.eos_ids == [2, 0]  # <|im_end|>, then <|endoftext|> (llama.cpp also stops on it)
    assert not ours.add_bos_token
    assert ours.token_to_id("<|im_end|>") == 2 and ours.id_to_token(2) == "<|im_end|>"
    assert ours.decode([1, 4093, 198, 6004, 2], skip_special=True) == "user\nhi"


@pytest.mark.parametrize("bad", [49152, 10**9, -1])
def test_decode_rejects_out_of_range_ids(ours, bad):
    with pytest.raises(ValueError, match=str(bad)):
        ours.decode([1, bad])


def test_tiny_gguf_tokenizer_special_and_user_tokens(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama")
    tok = Tokenizer.from_dir(import_gguf(path, tmp_path / "out", progress=False))
    think = tok.token_to_id("<think>")
    assert tok.encode("<think> the") == [think, tok.token_to_id("Ġthe")]  # user-defined stays whole
    assert tok.decode([think], skip_special=True) == "<think>"  # ...and is not special
    assert tok.encode("<|im_end|>") == [2] and tok.decode([2], skip_special=True) == ""
    # llama.cpp's "[PAD<id>]" filler is not a real token: the text is cut into bytes like any other.
    assert len(tok.encode(f"[PAD{tok.vocab_size - 1}]")) > 1
    assert tok.chat_template is not None and tok.eos_ids == [2, 0]


def _reference_split(pre: str):
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), "isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_tokenizers_match_transformers_tables(pre):
    from conftest import TINY_MERGES, tiny_vocab

    tokens, types = tiny_vocab()
    backend = tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                   "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                   "tokenizer.ggml.merges": TINY_MERGES})
    reference = _reference_split(pre)
    for text in TEXTS:
        assert backend.pre_tokenizer.pre_tokenize_str(text) == reference.pre_tokenize_str(text), text
    digits = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("12345")]
    assert digits == (["123", "45"] if pre == "llama-bpe" else list("12345"))
    if pre == "qwen2":  # Qwen's tokenizer.json normalizes to NFC
        assert backend.normalizer.normalize_str("e\u0301") == "é"


# --- chat templates -------------------------------------------------------------------------------

CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Bonjour ! 日本"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_chat_template_equals_transformers(ours, reference, add_generation_prompt):
    for chat in CHATS:
        want = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.chat_template.render(chat, add_generation_prompt=add_generation_prompt) == want


QWEN_STYLE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are helpful.{%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined %}
        {{- '<|im_start|>assistant' }}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
            {{- tool_call.function.arguments | tojson(indent=2) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- elif message.role != "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have these functions:\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Only user and assistant roles are supported, got " + message['role']) }}
    {%- endif %}
    {%- if loop.index0 > 5 %}{%- break %}{%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# No whitespace control in the tags: only trim_blocks + lstrip_blocks make this render compactly.
PLAIN_BLOCKS = """{% for message in messages %}
    {% if message['role'] == 'user' %}
U: {{ message['content'] }}
    {% else %}
{{ message['role'][0] | upper }}: {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
A:{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo <now> & later",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
]


@pytest.mark.parametrize("source,kwargs", [
    (QWEN_STYLE, {}),
    (LLAMA3_STYLE, {"date_string": "26 Jul 2024"}),
    (PLAIN_BLOCKS, {}),
])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_templates_equal_transformers(reference, source, kwargs, tools):
    chats = CHATS + ([TOOL_CHAT] if source is QWEN_STYLE else [])
    template = ChatTemplate(source, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    for chat in chats:
        want = reference.apply_chat_template(chat, chat_template=source, tools=tools, tokenize=False,
                                             add_generation_prompt=True, bos_token="<|begin_of_text|>", **kwargs)
        assert template.render(chat, add_generation_prompt=True, tools=tools, **kwargs) == want
    if tools and "tojson" in source:  # tojson keeps non-ASCII and <, &: no HTML escaping
        assert "Météo <now> & later" in template.render(CHATS[0], tools=tools, **kwargs)


def test_raise_exception_and_strftime_now():
    template = ChatTemplate(LLAMA3_STYLE, bos_token="<s>")
    with pytest.raises(TemplateError, match="got tool"):
        template.render([{"role": "tool", "content": "x"}])
    from datetime import datetime
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in template.render(CHATS[1])


def test_template_errors_and_sandbox():
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    # The immutable sandbox: a template cannot mutate what it is given or reach Python internals.
    with pytest.raises(TemplateError):
        ChatTemplate("{% set _ = messages.append(1) %}").render(CHATS[0])
    with pytest.raises(TemplateError):
        ChatTemplate("{{ cycler.__init__.__globals__ }}").render(CHATS[0])


def test_template_sources_in_a_folder(tmp_path):
    assert ChatTemplate.from_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ bos_token }}DEFAULT"}]}))
    assert ChatTemplate.from_dir(tmp_path, bos_token="<s>").render([]) == "<s>DEFAULT"
    (tmp_path / "chat_template.jinja").write_text("JINJA {{ messages | length }}")
    assert ChatTemplate.from_dir(tmp_path).render(CHATS[0]) == "JINJA 2"
