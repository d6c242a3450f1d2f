"""The OpenAI API: /v1/chat/completions, /v1/completions, /v1/models, and vLLM's /tokenize and
/detokenize. Requests become the neutral input of endpoints/chat.py; its result and messages
become OpenAI's objects and `chat.completion.chunk` / `text_completion` stream chunks."""
from __future__ import annotations

import hashlib
import secrets
import time
from importlib.metadata import version
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import ApiError
from .inferlets import Call
from .routes import Api, Flag, Route, Serving, Shape, Strict, answer, count
from .sse import frame

__all__ = ["API", "ROUTES", "usage"]

# neutral kind -> (status, OpenAI error type, code)
_ERRORS = {"invalid_request": (400, "invalid_request_error", None),
           "context_length_exceeded": (400, "invalid_request_error", "context_length_exceeded"),
           "missing_key": (401, "invalid_request_error", "invalid_api_key"),
           "invalid_key": (401, "invalid_request_error", "invalid_api_key"),
           "not_found": (404, "invalid_request_error", "model_not_found"),
           "no_route": (404, "invalid_request_error", None), "wrong_method": (405, "invalid_request_error", None),
           "rate_limited": (429, "rate_limit_exceeded", "rate_limit_exceeded"),
           "unavailable": (503, "server_error", "engine_loading"),
           "server_error": (500, "server_error", None)}


def _shape(error: ApiError) -> tuple[int, dict]:
    status, kind, code = _ERRORS[error.kind]
    return status, {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


API = Api("openai", _shape)
FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


# ---- request shapes ----------------------------------------------------------------------------

class ContentPart(Shape):
    type: str
    text: Optional[str] = None


class FunctionCall(Shape):
    name: str
    arguments: str = "{}"


class ToolCall(Shape):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Shape):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None


class FunctionSpec(Shape):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(Shape):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(Shape):
    name: str


class NamedToolChoice(Shape):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Shape):
    name: str = "response"
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StreamOptions(Shape):
    include_usage: Optional[Flag] = None


class Sampling(Strict):
    """Fields both generation routes take (top_k, min_p, ignore_eos and stop_token_ids are extras, as
    in vLLM). A field neither OpenAI nor these extras have is refused, as OpenAI refuses it, so a
    misspelled or unsupported setting is not silently without effect; OpenAI's fields that only
    label a request for its owner (user, metadata, store, service_tier, prompt_cache_key,
    safety_identifier) are taken and have no effect here."""
    model: str
    stream: Flag = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, Annotated[list[str], Field(max_length=4)], None] = None
    n: int = Field(1, ge=1, le=128)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = None
    ignore_eos: Flag = False
    stop_token_ids: Optional[list[int]] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[Flag] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None

    def neutral(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k if self.top_k and self.top_k > 0 else None, "min_p": self.min_p,
                "seed": self.seed, "stop": [self.stop] if isinstance(self.stop, str) else self.stop, "n": self.n,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "logit_bias": self.logit_bias, "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids}

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Sampling):
    not_implemented = frozenset({"audio", "modalities", "prediction", "functions", "function_call", "moderation",
                                 "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "verbosity",
                                 "web_search_options"})
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[Flag] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[Flag] = None
    response_format: Optional[ResponseFormat] = None


class CompletionRequest(Sampling):
    """A prompt is text or token ids (as OpenAI's spec and vLLM take them), or a list of either."""
    not_implemented = frozenset({"best_of", "suffix"})
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Flag = False
    logprobs: Optional[int] = Field(None, ge=0, le=5)


class TokenizeRequest(Shape):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None


class DetokenizeRequest(Shape):
    model: Optional[str] = None
    tokens: list[int]


# ---- requests -> the endpoint's input ----------------------------------------------------------

def _text(content: Union[str, list[ContentPart], None]) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError("invalid_request", f"only text content parts are supported, not {part.type!r}",
                           "messages")
    return "\n".join(part.text for part in content)


def _message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                             for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"], out["name"] = m.tool_call_id, m.name
    return out


def _response_format(fmt: Optional[ResponseFormat]) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":      # OpenAI's JSON mode: the reply is a JSON object
        return {"type": "json_schema", "schema": {"type": "object"}}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError("invalid_request", "response_format json_schema needs json_schema.schema", "response_format")
    return {"type": "json_schema", "schema": fmt.json_schema.schema_}


def chat_input(body: ChatRequest) -> dict[str, Any]:
    choice = body.tool_choice
    return {**body.neutral(), "messages": [_message(m) for m in body.messages],
            "max_tokens": body.max_completion_tokens or body.max_tokens,
            "logprobs": bool(body.logprobs), "top_logprobs": body.top_logprobs,
            "tools": [{"name": t.function.name, "description": t.function.description,
                       "parameters": t.function.parameters} for t in body.tools or []],
            "tool_choice": {"name": choice.function.name} if isinstance(choice, NamedToolChoice) else choice,
            "parallel_tool_calls": body.parallel_tool_calls, "response_format": _response_format(body.response_format)}


def completion_input(body: CompletionRequest) -> dict[str, Any]:
    return {**body.neutral(), "prompt": body.prompt, "echo": body.echo, "max_tokens": body.max_tokens or 16,
            "logprobs": body.logprobs is not None, "top_logprobs": body.logprobs}


# ---- results -> OpenAI objects -----------------------------------------------------------------

def usage(u: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens") or 0)}}


def _chat_logprobs(entries: list | None) -> dict | None:
    if entries is None:
        return None
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                                          for t in e.get("top", [])]} for e in entries]}


def _completion_logprobs(entries: list | None, offset: int = 0) -> dict | None:
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top", [])} for e in entries],
            "text_offset": offsets}


def _tool_calls(calls: list) -> list[dict] | None:
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls] or None


def _reply(choice: dict) -> tuple[str, list[dict]]:
    """A chat choice's text and calls. A call the length cut off is a call with the arguments written
    so far (finish_reason "length" tells the client they are incomplete), as OpenAI returns one;
    cut before its name, it is text."""
    cut, text, calls = choice.get("cut_call"), choice.get("text") or "", list(choice.get("tool_calls") or [])
    if cut is not None and cut.get("name") is not None:
        calls.append(cut)
    elif cut is not None:
        text += cut["text"]
    return text, calls


def fingerprint(serving: Serving) -> str:
    """The system_fingerprint of the replies: a short hash of what produces them (the model, its
    dtype, this pie_actors), the same for every reply while those stay the same."""
    served = f"{serving.model}|{serving.runtime.config.engine.dtype}|{version('pie-actors')}"
    return "fp_" + hashlib.sha256(served.encode()).hexdigest()[:10]


class _Reply:
    """The id, time, model name and fingerprint that every object and chunk of one reply carries."""

    def __init__(self, kind: str, serving: Serving, model: str) -> None:
        self.id, self.created, self.model = f"{kind}-{secrets.token_hex(12)}", int(time.time()), model
        self.fingerprint = fingerprint(serving)

    def object(self, kind: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}


def _chat_choice(c: dict) -> dict[str, Any]:
    text, calls = _reply(c)
    return {"index": c["index"], "finish_reason": FINISH.get(c.get("finish_reason"), "stop"),
            "message": {"role": "assistant", "content": text if text or not calls else None,
                        "tool_calls": _tool_calls(calls),
                        **({"reasoning_content": c["thinking"]} if c.get("thinking") else {})},
            "logprobs": _chat_logprobs(c.get("logprobs"))}


def chat_response(result: dict, reply: _Reply) -> dict[str, Any]:
    return reply.object("chat.completion", [_chat_choice(c) for c in result["choices"]],
                        usage=usage(result.get("usage") or {}))


def completion_response(result: dict, reply: _Reply) -> dict[str, Any]:
    choices = [{"index": c["index"], "text": c.get("text", ""), "finish_reason": FINISH.get(c.get("finish_reason"), "stop"),
                "logprobs": _completion_logprobs(c.get("logprobs"))} for c in result["choices"]]
    return reply.object("text_completion", choices, usage=usage(result.get("usage") or {}))


async def _chunks(call: Call, reply: _Reply, kind: str, include_usage: bool, opening: list[dict],
                  delta: Any) -> AsyncIterator[str]:
    """The stream of one reply: the `opening` chunks, then `delta(message)` -> the chunks' choice
    fields for each message (None: nothing to send), the usage chunk when asked for, and [DONE]."""
    extra = {"usage": None} if include_usage else {}
    for choice in opening:
        yield frame(reply.object(kind, [choice], **extra))
    async for message in call.messages():
        for choice in delta(message) or []:
            yield frame(reply.object(kind, [choice], **extra))
    if include_usage:
        yield frame(reply.object(kind, [], usage=usage(call.usage)))
    yield frame("[DONE]")


def _roles(choices: int) -> list[dict]:
    """Each chat choice's stream opens with its role."""
    return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(choices)]


def _chat_delta(logprobs: bool):
    def delta(m: dict) -> list[dict] | None:
        kind = m.get("type")
        base = {"index": m.get("choice", 0), "logprobs": None, "finish_reason": None}
        if kind == "text":
            return [{**base, "delta": {"content": m["text"]},
                     "logprobs": _chat_logprobs(m.get("logprobs")) if logprobs else None}]
        if kind == "thinking":
            return [{**base, "delta": {"reasoning_content": m["text"]}}]
        if kind == "cut_call" and m.get("name") is None:
            return [{**base, "delta": {"content": m["text"]}}]
        if kind in ("tool_call", "cut_call"):      # id, type and name first, then the arguments
            head = {"index": m["index"], "id": m["id"], "type": "function",
                    "function": {"name": m["name"], "arguments": ""}}
            return [{**base, "delta": {"tool_calls": [head]}},
                    {**base, "delta": {"tool_calls": [{"index": m["index"], "function": {"arguments": m["arguments"]}}]}}]
        if kind == "finish":
            return [{**base, "delta": {}, "finish_reason": FINISH.get(m.get("reason"), "stop")}]
        return None
    return delta


def _completion_delta(logprobs: bool):
    def delta(m: dict) -> list[dict] | None:
        kind = m.get("type")
        base = {"index": m.get("choice", 0), "text": "", "logprobs": None, "finish_reason": None}
        if kind == "text":
            return [{**base, "text": m["text"],
                     "logprobs": _completion_logprobs(m.get("logprobs")) if logprobs else None}]
        if kind == "finish":
            return [{**base, "finish_reason": FINISH.get(m.get("reason"), "stop")}]
        return None
    return delta


# ---- handlers ----------------------------------------------------------------------------------

async def chat_completions(serving: Serving, request: Request, body: ChatRequest) -> Response:
    reply = _Reply("chatcmpl", serving, serving.check_model(body.model))
    return await answer(serving, request, "/v1/chat/completions", chat_input(body), body.stream,
                        lambda result: chat_response(result, reply),
                        lambda call, start: _chunks(call, reply, "chat.completion.chunk", body.include_usage(),
                                                    _roles(body.n), _chat_delta(bool(body.logprobs))), API,
                        written={"max_tokens": "max_completion_tokens"} if body.max_completion_tokens else {})


async def completions(serving: Serving, request: Request, body: CompletionRequest) -> Response:
    reply = _Reply("cmpl", serving, serving.check_model(body.model))
    return await answer(serving, request, "/v1/completions", completion_input(body), body.stream,
                        lambda result: completion_response(result, reply),
                        lambda call, start: _chunks(call, reply, "text_completion", body.include_usage(), [],
                                                    _completion_delta(body.logprobs is not None)), API)


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pie"}


async def list_models(serving: Serving, request: Request, body: None) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(name) for name in serving.names]})


async def get_model(serving: Serving, request: Request, body: None) -> Response:
    return JSONResponse(_model_card(serving.check_model(request.path_params["model"])))


async def tokenize(serving: Serving, request: Request, body: TokenizeRequest) -> Response:
    if body.model is not None:
        serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError("invalid_request", "give either prompt or messages", "prompt")
    input = {"prompt": body.prompt} if body.prompt is not None else {"messages": [_message(m) for m in body.messages]}
    result = await count(serving, request, "/tokenize", input)
    return JSONResponse({"count": result["prompt_tokens"], "max_model_len": result.get("max_position"),
                         "tokens": result["tokens"][0]})


async def detokenize(serving: Serving, request: Request, body: DetokenizeRequest) -> Response:
    if body.model is not None:
        serving.check_model(body.model)
    result = await count(serving, request, "/detokenize", {"tokens": body.tokens})
    return JSONResponse({"prompt": result.get("prompt", "")})


ROUTES = [
    Route("POST", "/v1/chat/completions", API, chat_completions, "Chat completions (streamed with stream: true).",
          ChatRequest, streams=True),
    Route("POST", "/v1/completions", API, completions, "Text completions of one prompt or a list of them.",
          CompletionRequest, streams=True),
    Route("GET", "/v1/models", API, list_models, "The names the model answers to.", engine=False),
    Route("GET", "/v1/models/{model}", API, get_model, "One of the model's names.", engine=False),
    Route("POST", "/tokenize", API, tokenize, "The token ids of a prompt, or of messages in the chat template.",
          TokenizeRequest),
    Route("POST", "/detokenize", API, detokenize, "The text of token ids.", DetokenizeRequest),
]
