"""The Anthropic API: /v1/messages (its full event stream) and /v1/messages/count_tokens. Requests
become the neutral input of endpoints/chat.py; its result and messages become a Message and the
message_start ... message_stop events."""
from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator, Literal, Optional, Union

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import ApiError
from .inferlets import Call
from .routes import Api, Flag, Route, Serving, Shape, answer, count
from .sse import frame

__all__ = ["API", "ROUTES"]

_ERRORS = {"invalid_request": (400, "invalid_request_error"), "context_length_exceeded": (400, "invalid_request_error"),
           "missing_key": (401, "authentication_error"), "invalid_key": (401, "authentication_error"),
           "not_found": (404, "not_found_error"), "no_route": (404, "not_found_error"),
           "wrong_method": (405, "invalid_request_error"),
           "unavailable": (529, "overloaded_error"),       # Anthropic's "overloaded, retry later"
           "rate_limited": (429, "rate_limit_error"),
           "server_error": (500, "api_error")}


def _shape(error: ApiError) -> tuple[int, dict]:
    status, kind = _ERRORS[error.kind]
    return status, {"type": "error", "error": {"type": kind, "message": error.message}}


API = Api("anthropic", _shape, error_event="error")
STOP_REASON = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}


# ---- request shapes ----------------------------------------------------------------------------

class Block(Shape):
    """A content block: text, tool_use, tool_result or thinking (others are refused)."""
    type: str
    text: Optional[str] = None
    id: Optional[str] = None
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None
    content: Union[str, list["Block"], None] = None
    thinking: Optional[str] = None


class Message(Shape):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class ToolSpec(Shape):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: Optional[str] = None
    input_schema: dict[str, Any]


class ToolChoice(Shape):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[Flag] = None


class Thinking(Shape):
    type: Literal["enabled", "disabled"]
    budget_tokens: Optional[int] = None


class Prompt(Shape):
    """What counting and generating both take."""
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[Block], None] = None
    tools: Optional[list[ToolSpec]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None

    def neutral(self) -> dict[str, Any]:
        system = [{"role": "system", "content": _text(self.system, "system")}] if self.system else []
        choice = self.tool_choice
        tool_choice = None if choice is None else {"name": choice.name} if choice.type == "tool" else \
            {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        _check_content(self.messages)
        # Thinking of the turn in progress (a tool-use loop since the last user text) is fed back,
        # as Anthropic keeps it; that of completed turns is dropped, as Anthropic does.
        asked = max((i for i, m in enumerate(self.messages) if m.role == "user" and not _tool_results(m)), default=0)
        return {"messages": system + [m for i, message in enumerate(self.messages)
                                      for m in _messages(message, keep_thinking=i > asked)],
                "tools": [{"name": t.name, "description": t.description, "parameters": t.input_schema}
                          for t in self.tools or []],
                "tool_choice": tool_choice, "thinking": bool(self.thinking and self.thinking.type == "enabled"),
                "parallel_tool_calls": None if choice is None or choice.disable_parallel_tool_use is None
                else not choice.disable_parallel_tool_use}


class OutputFormat(Shape):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Shape):
    format: Optional[OutputFormat] = None


class MessagesRequest(Prompt):
    """temperature, top_p and top_k are taken as older clients send them."""
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: Flag = False
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    output_config: Optional[OutputConfig] = None


class CountRequest(Prompt):
    pass


Block.model_rebuild()


# ---- requests -> the endpoint's input ----------------------------------------------------------

def _text(content: Union[str, list[Block], None], where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for block in content:
        if block.type != "text":
            raise ApiError("invalid_request", f"{where}: only text blocks are supported here, not {block.type!r}", where)
    return "\n".join(block.text or "" for block in content)


def _check_content(messages: list[Message]) -> None:
    """Every message has content, but for a final assistant message (a prefill), as Anthropic requires."""
    for i, message in enumerate(messages):
        if not message.content and not (i == len(messages) - 1 and message.role == "assistant"):
            raise ApiError("invalid_request", f"messages.{i}.content: all messages must have non-empty content "
                                              "except for the optional final assistant message",
                           f"messages.{i}.content")


def _tool_results(message: Message) -> bool:
    """Whether a user message holds only tool results (it continues the turn, asks nothing new)."""
    return isinstance(message.content, list) and all(b.type == "tool_result" for b in message.content)


def _messages(message: Message, keep_thinking: bool) -> list[dict[str, Any]]:
    """One Anthropic message as neutral messages: text, tool calls, and each tool result its own;
    its thinking when `keep_thinking`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out, texts, calls, thoughts = [], [], [], []
    for block in message.content:
        if block.type == "thinking" and message.role == "assistant":
            thoughts.append(block.thinking or "")
        elif block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append({"id": block.id, "name": block.name, "arguments": json.dumps(block.input or {})})
        elif block.type == "tool_result" and message.role == "user":
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _text(block.content, "tool_result.content")})
        elif block.type != "redacted_thinking":           # encrypted elsewhere: nothing to feed back
            raise ApiError("invalid_request", f"messages: {message.role} content blocks of type {block.type!r} "
                                              "are not supported", "messages")
    thinking = "\n".join(thoughts) if keep_thinking and any(thoughts) else None
    if texts or calls or thinking or not out:
        out.append({"role": message.role, "content": "\n".join(texts), **({"tool_calls": calls} if calls else {}),
                    **({"thinking": thinking} if thinking else {})})
    return out


def messages_input(body: MessagesRequest) -> dict[str, Any]:
    output = body.output_config.format if body.output_config else None
    return {**body.neutral(), "max_tokens": body.max_tokens, "stop": body.stop_sequences,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k or None,
            "response_format": {"type": "json_schema", "schema": output.schema_} if output else None}


# ---- results -> Anthropic objects --------------------------------------------------------------

def _usage(u: dict[str, Any]) -> dict[str, int]:
    cached = int(u.get("cached_tokens") or 0)
    return {"input_tokens": int(u.get("prompt_tokens") or 0) - cached,
            "output_tokens": int(u.get("completion_tokens") or 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message(model: str, content: list, usage: dict, stop_reason=None, stop_sequence=None) -> dict[str, Any]:
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def _tool_use(call: dict) -> dict[str, Any]:
    return {"type": "tool_use", "id": call["id"], "name": call["name"], "input": json.loads(call["arguments"])}


def messages_response(result: dict, model: str) -> dict[str, Any]:
    reply = result["choices"][0]
    content = ([{"type": "thinking", "thinking": reply["thinking"], "signature": ""}] if reply.get("thinking") else [])
    # A call the length cut off has no valid input for a tool_use block: its text is a text block
    # (stop_reason max_tokens), so what was generated is not lost.
    cut = (reply.get("cut_call") or {}).get("text", "")
    text = (reply.get("text") or "") + cut
    if text or not reply.get("tool_calls"):
        content.append({"type": "text", "text": text})
    content += [_tool_use(c) for c in reply.get("tool_calls") or []]
    return _message(model, content, _usage(result.get("usage") or {}),
                    STOP_REASON.get(reply.get("finish_reason"), "end_turn"), reply.get("stop_sequence"))


class _Stream:
    """A streamed message's events after message_start: content blocks opened, filled and closed
    as the messages come (the first block is followed by a ping), then message_delta and
    message_stop."""

    def __init__(self) -> None:
        self.index, self.kind, self.pinged = -1, None, False
        self.reason, self.stop_sequence = "end_turn", None

    def on(self, m: dict) -> list[str]:
        kind = m.get("type")
        if kind in ("text", "cut_call") and m["text"]:          # a cut call as text, as in messages_response
            return self._into("text", {"type": "text", "text": ""}) + [self._delta(type="text_delta", text=m["text"])]
        if kind == "thinking":
            return (self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    + [self._delta(type="thinking_delta", thinking=m["text"])])
        if kind == "tool_call":
            return (self._open("tool_use", {"type": "tool_use", "id": m["id"], "name": m["name"], "input": {}})
                    + [self._delta(type="input_json_delta", partial_json=m["arguments"])])
        if kind == "finish":
            self.reason, self.stop_sequence = STOP_REASON.get(m.get("reason"), "end_turn"), m.get("stop_sequence")
        return []

    def end(self, usage: dict) -> list[str]:
        empty = self._open("text", {"type": "text", "text": ""}) if self.index < 0 else []   # an empty reply's block
        return empty + self._close() + [
            frame({"type": "message_delta", "delta": {"stop_reason": self.reason, "stop_sequence": self.stop_sequence},
                   "usage": {"output_tokens": int(usage.get("completion_tokens") or 0)}}, "message_delta"),
            frame({"type": "message_stop"}, "message_stop")]

    def _into(self, kind: str, block: dict) -> list[str]:
        return [] if self.kind == kind else self._open(kind, block)

    def _open(self, kind: str, block: dict) -> list[str]:
        events = self._close()
        self.index, self.kind = self.index + 1, kind
        events.append(frame({"type": "content_block_start", "index": self.index, "content_block": block},
                            "content_block_start"))
        if not self.pinged:
            self.pinged = True
            events.append(frame({"type": "ping"}, "ping"))
        return events

    def _delta(self, **delta: Any) -> str:
        return frame({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [frame({"type": "content_block_stop", "index": self.index}, "content_block_stop")]


async def _events(call: Call, start: dict, model: str) -> AsyncIterator[str]:
    yield frame({"type": "message_start", "message": _message(model, [], _usage({**start, "completion_tokens": 0}))},
                "message_start")
    stream = _Stream()
    async for message in call.messages():
        for event in stream.on(message):
            yield event
    for event in stream.end(call.usage):
        yield event


# ---- handlers ----------------------------------------------------------------------------------

async def messages(serving: Serving, request: Request, body: MessagesRequest) -> Response:
    model = serving.check_model(body.model)
    return await answer(serving, request, "/v1/messages", messages_input(body), body.stream,
                        lambda result: messages_response(result, model),
                        lambda call, start: _events(call, start, model), API)


async def count_tokens(serving: Serving, request: Request, body: CountRequest) -> Response:
    serving.check_model(body.model)
    result = await count(serving, request, "/v1/messages/count_tokens", body.neutral())
    return JSONResponse({"input_tokens": result["prompt_tokens"]})


ROUTES = [
    Route("POST", "/v1/messages", API, messages, "Messages (streamed with stream: true).", MessagesRequest,
          streams=True),
    Route("POST", "/v1/messages/count_tokens", API, count_tokens, "The input tokens of a Messages request.",
          CountRequest),
]
