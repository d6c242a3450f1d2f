"""Chat templates: the Jinja program a model ships to turn a conversation into its prompt text.

Rendered the way transformers' `apply_chat_template` renders them (same environment options and helpers),
so a model's template behaves here as it does everywhere else. Templates come from model files, i.e. from
strangers, so they run in jinja2's immutable sandbox.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """A chat template failed to compile, or refused the conversation (`raise_exception` in the template)."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '); templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e

    @classmethod
    def from_dir(cls, folder: str | Path, bos_token: str = "", eos_token: str = "") -> ChatTemplate | None:
        """The template of a Hugging Face model folder, or None when it has none.

        Newer folders keep it in `chat_template.jinja`, older ones in tokenizer_config.json's
        "chat_template" (a string, or a list of named templates of which we use "default").
        """
        folder = Path(folder)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), bos_token, eos_token)
        config_file = folder / "tokenizer_config.json"
        if not config_file.is_file():
            return None
        source = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        return cls(source, bos_token, eos_token) if isinstance(source, str) and source else None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages`; extra keyword arguments become template variables."""
        # OpenAI-style messages carry `content: None` next to tool calls; templates handle a missing key
        # but would print "None", so drop None values as transformers does.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e
