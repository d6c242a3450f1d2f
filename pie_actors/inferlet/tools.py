"""Tool calling on the host: the family's prompt format, its call grammar and a streaming call parser.

Two families of call syntax, told apart by the chat template:

- "hermes" (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  tool results in `<tool_response>` blocks. Templates that take no tools at all (SmolLM2) get this
  format too, with the instructions written into the system turn by `ToolFormat` itself.
- "llama3" (Llama 3.1 / 3.2 JSON tool calling): the reply is `{"name": ..., "parameters": {...}}`,
  tool results come back in an `ipython` turn.

Where the template renders tools itself, `equip` and `answer` render through it (`tools=`), so
the prompt is exactly the model's own. `ToolCallDecoder` reads generated tokens and reports
events as dicts: {"type": "start"}, {"type": "call", "name", "arguments_json"}, and
{"type": "error", "message", "text"} for call text that does not parse.
"""
from __future__ import annotations

import json
from typing import Any

from .textstream import TextStream, tag_prefix_len

__all__ = ["ToolError", "ToolFormat", "ToolCallDecoder", "normalize_specs", "call_schema"]

HERMES, LLAMA3 = "hermes", "llama3"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

# The Hermes / Qwen instructions, for templates that do not render tools themselves.
_HERMES_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')

# Calls are written compactly and always the same way, so a small model cannot wander off in
# whitespace; a schema may override this with its own "x-guidance".
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """Tool specs or a tool result that cannot be formatted."""


def normalize_specs(specs: Any) -> list[dict]:
    """Tool specs as OpenAI-style {"type": "function", "function": {name, description, parameters}}.

    Accepts that form or the bare function object; `parameters` defaults to an empty object schema.
    """
    if not isinstance(specs, list) or not specs:
        raise ToolError("tool specs must be a non-empty list of JSON function schemas")
    out = []
    for spec in specs:
        fn = spec.get("function", spec) if isinstance(spec, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"a tool spec needs a function name: {spec!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tool {fn['name']!r}: parameters must be a JSON schema object")
        out.append(spec if "function" in spec else {"type": "function", "function": {**fn, "parameters": params}})
    return out


def call_schema(specs: list[dict], family: str) -> dict:
    """JSON schema of one valid call to any of `specs` (normalized) in `family`'s syntax."""
    key = "parameters" if family == LLAMA3 else "arguments"
    options = []
    for spec in specs:
        fn = spec["function"]
        params = fn.get("parameters", {"type": "object", "properties": {}})
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
                        "required": ["name", key], "additionalProperties": False})
    return {"anyOf": options, "x-guidance": JSON_STYLE}


class ToolFormat:
    """The tool-call format of one chat template."""

    def __init__(self, template_source: str) -> None:
        self.native = "tools" in template_source          # the template renders `tools=` itself
        if CALL_OPEN in template_source or not self.native:
            self.family = HERMES
        elif PYTHON_TAG in template_source or "ipython" in template_source:
            self.family = LLAMA3
        else:
            raise ToolError("this chat template's tool-call format is not supported "
                            "(supported: Hermes/Qwen <tool_call> and Llama 3.1 JSON)")

    def equip(self, chat, specs: Any, system: str | None = None) -> list[int]:
        """The opening turn that declares `specs` (and `system`, when given)."""
        specs = normalize_specs(specs)
        if not self.native:
            lines = "".join("\n" + json.dumps(s, ensure_ascii=False) for s in specs)
            text = _HERMES_PROMPT.format(tools=lines)
            return chat.system(f"{system}\n\n{text}" if system else text)
        new = [{"role": "system", "content": system}] if system is not None else []
        # Llama 3.1 would put the tools into the first user message; the system turn keeps them apart
        return chat.encode(chat.turn([], new, tools=specs, tools_in_user_message=False))

    def answer(self, chat, name: str, value: Any) -> list[int]:
        """A tool result turn: `value` (text as is, anything else as JSON) from tool `name`."""
        if not isinstance(name, str) or not name:
            raise ToolError("tools.answer needs the tool's name")
        content = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if not self.native:
            return chat.user(f"<tool_response>\n{content}\n</tool_response>")
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}
        before = chat.context() + [call]
        return chat.encode(chat.turn(before, [{"role": "tool", "name": name, "content": content}]))

    def grammar(self, specs: Any, tokenizer) -> str:
        """A Lark grammar (llguidance syntax) admitting only valid calls to `specs`."""
        schema = json.dumps(call_schema(normalize_specs(specs), self.family), ensure_ascii=False)
        if self.family == LLAMA3:
            return f"start: %json{schema}\n"
        # a tag the vocabulary has as one token must be that token (llguidance matches added tokens
        # only by name, <tag>); elsewhere it is plain text
        open_, close = (tag if tokenizer.token_to_id(tag) is not None else json.dumps(tag)
                        for tag in (CALL_OPEN, CALL_CLOSE))
        return f'start: call ("\\n" call)*\ncall: {open_} "\\n" %json{schema} "\\n" {close}\n'


def _parse_call(text: str) -> dict:
    """A call event for one call's JSON text, or an error event saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        return {"type": "error", "message": f"tool call is not valid JSON: {e}", "text": text}
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return {"type": "error", "message": "tool call has no function name", "text": text}
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):            # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return {"type": "error", "message": "tool call arguments are not a JSON object", "text": text}
    return {"type": "call", "name": obj["name"], "arguments_json": json.dumps(args, ensure_ascii=False)}



class ToolCallDecoder:
    """Finds tool calls in one reply as its tokens stream in (see the module docstring)."""

    def __init__(self, tokenizer, family: str) -> None:
        self._text = TextStream(tokenizer)
        self.family = family
        self._pending = ""           # text not yet classified
        self._call: str | None = None  # text of the call being read; None between calls
        self._depth = 0              # llama3: JSON nesting of the call being read
        self._in_string = self._escape = False
        self._plain = False          # llama3: the reply is ordinary text, not a call

    def feed(self, tokens: list[int]) -> list[dict]:
        self._pending += self._text.feed(tokens)
        events: list[dict] = []
        if self.family == LLAMA3:
            self._llama3(events)
        else:
            self._hermes(events)
        return events

    def finish(self) -> list[dict]:
        """The reply ended: a call still open is reported as an error."""
        if self._call is None:
            return []
        text, self._call = self._call + self._pending, None
        self._pending = ""
        return [{"type": "error", "message": "the reply ended inside a tool call", "text": text}]

    def _hermes(self, events: list[dict]) -> None:
        while True:
            if self._call is None:
                start = self._pending.find(CALL_OPEN)
                if start < 0:
                    self._pending = self._pending[len(self._pending) - tag_prefix_len(self._pending, CALL_OPEN):]
                    return
                self._pending, self._call = self._pending[start + len(CALL_OPEN):], ""
                events.append({"type": "start"})
            end = self._pending.find(CALL_CLOSE)
            if end < 0:
                keep = tag_prefix_len(self._pending, CALL_CLOSE)
                self._call += self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return
            body = self._call + self._pending[:end]
            self._pending, self._call = self._pending[end + len(CALL_CLOSE):], None
            events.append(_parse_call(body.strip()))

    def _llama3(self, events: list[dict]) -> None:
        # a call is a JSON object at the start of the reply (after an optional <|python_tag|>),
        # optionally followed by more calls separated by blank space or ";"
        while not self._plain and self._pending:
            if self._call is None:
                head = self._pending.lstrip(" \t\r\n;")
                if head.startswith(PYTHON_TAG):
                    head = head[len(PYTHON_TAG):].lstrip()
                if not head or PYTHON_TAG.startswith(head):     # wait for the next tokens
                    self._pending = head
                    return
                if not head.startswith("{"):
                    self._plain = True
                    self._pending = ""
                    return
                self._pending, self._call, self._depth = head, "", 0
                events.append({"type": "start"})
            end = self._scan_json()
            if end < 0:
                self._call += self._pending
                self._pending = ""
                return
            body = self._call + self._pending[:end]
            self._pending, self._call = self._pending[end:], None
            events.append(_parse_call(body))

    def _scan_json(self) -> int:
        """Index just past the end of the JSON object in `_pending` (continuing the scan state of
        the call read so far), or -1 when it has not ended yet."""
        for i, ch in enumerate(self._pending):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return -1
