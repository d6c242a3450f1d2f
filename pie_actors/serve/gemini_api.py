"""The Gemini API: models/{model}:generateContent, :streamGenerateContent (server-sent events with
?alt=sse, else a streamed JSON array) and
:countTokens, under /v1beta, /v1 (where google-genai sends them by default) and no prefix. Requests
become the neutral input of endpoints/chat.py; its result and messages become
GenerateContentResponses."""
from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator, Literal, Optional

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import ApiError
from .inferlets import GEMINI_COUNT, GEMINI_GENERATE, Call
from .routes import Api, Flag, Route, Serving, Shape, answer, count
from .sse import SSE, frame

__all__ = ["API", "ROUTES", "json_schema"]

# The real API's answers: no key is 403, a wrong key 400.
_ERRORS = {"invalid_request": (400, "INVALID_ARGUMENT"), "context_length_exceeded": (400, "INVALID_ARGUMENT"),
           "missing_key": (403, "PERMISSION_DENIED"), "invalid_key": (400, "INVALID_ARGUMENT"),
           "not_found": (404, "NOT_FOUND"), "no_route": (404, "NOT_FOUND"), "unavailable": (503, "UNAVAILABLE"),
           "wrong_method": (404, "NOT_FOUND"),            # Google's status codes have no "method not allowed"
           "server_error": (500, "INTERNAL"),
           "rate_limited": (429, "RESOURCE_EXHAUSTED")}


def _shape(error: ApiError) -> tuple[int, dict]:
    status, kind = _ERRORS[error.kind]
    return status, {"error": {"code": status, "message": error.message, "status": kind}}


API = Api("gemini", _shape)
FINISH = {"stop": "STOP", "stop_sequence": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS"}


# ---- request shapes ----------------------------------------------------------------------------

class FunctionCall(Shape):
    name: str
    args: Optional[dict[str, Any]] = None
    id: Optional[str] = None


class FunctionResponse(Shape):
    name: str
    response: Optional[dict[str, Any]] = None
    id: Optional[str] = None


class Part(Shape):
    text: Optional[str] = None
    functionCall: Optional[FunctionCall] = None
    functionResponse: Optional[FunctionResponse] = None
    thought: Optional[Flag] = None


class Content(Shape):
    role: Optional[str] = None
    parts: list[Part] = Field(default_factory=list)


class FunctionDeclaration(Shape):
    name: str = Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_.-]{0,63}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    parametersJsonSchema: Optional[dict[str, Any]] = None


class Tool(Shape):
    functionDeclarations: Optional[list[FunctionDeclaration]] = None


class FunctionCallingConfig(Shape):
    mode: Optional[Literal["MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"]] = None
    allowedFunctionNames: Optional[list[str]] = None


class ToolConfig(Shape):
    functionCallingConfig: Optional[FunctionCallingConfig] = None


class GenerationConfig(Shape):
    temperature: Optional[float] = Field(None, ge=0, le=2)
    topP: Optional[float] = Field(None, gt=0, le=1)
    topK: Optional[int] = Field(None, ge=0)
    maxOutputTokens: Optional[int] = Field(None, ge=1)
    stopSequences: Optional[list[str]] = Field(None, max_length=5)
    candidateCount: Optional[int] = Field(None, ge=1, le=8)
    seed: Optional[int] = None
    presencePenalty: Optional[float] = None
    frequencyPenalty: Optional[float] = None
    responseMimeType: Optional[str] = None
    responseSchema: Optional[dict[str, Any]] = None
    responseJsonSchema: Optional[dict[str, Any]] = None


class GenerateRequest(Shape):
    contents: list[Content] = Field(min_length=1)
    systemInstruction: Optional[Content] = None
    tools: Optional[list[Tool]] = None
    toolConfig: Optional[ToolConfig] = None
    generationConfig: Optional[GenerationConfig] = None


class CountRequest(Shape):
    contents: Optional[list[Content]] = None
    generateContentRequest: Optional[GenerateRequest] = None


# ---- requests -> the endpoint's input ----------------------------------------------------------

_COUNTS = {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}


def json_schema(schema: Any) -> Any:
    """A Gemini Schema (OpenAPI's subset: upper-case types, `nullable`, int64 bounds as strings) as
    the JSON schema the grammar takes."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: json_schema(s) for name, s in value.items()}
        elif key in ("items", "anyOf"):
            out[key] = json_schema(value)
        elif key in _COUNTS and isinstance(value, str) and value.isdigit():
            out[key] = int(value)
        elif key not in ("nullable", "propertyOrdering", "property_ordering"):
            out[key] = value
    return {"anyOf": [out, {"type": "null"}]} if schema.get("nullable") is True else out


def _contents(contents: list[Content], system: Optional[Content]) -> list[dict[str, Any]]:
    messages = []
    if system is not None:
        messages.append({"role": "system", "content": "\n".join(p.text or "" for p in system.parts)})
    for turn, content in enumerate(contents):
        if not content.parts:                      # as Google's API refuses it
            raise ApiError("invalid_request", f"contents[{turn}].parts must not be empty", f"contents[{turn}].parts")
        texts, calls = [], []
        role = "assistant" if content.role == "model" else "user"
        for i, part in enumerate(content.parts):
            if part.thought:
                continue                           # earlier thinking is not fed back
            if part.functionCall is not None:
                call = part.functionCall
                calls.append({"id": call.id or f"call_{turn}_{i}", "name": call.name,
                              "arguments": json.dumps(call.args or {})})
            elif part.functionResponse is not None:
                result = part.functionResponse
                messages.append({"role": "tool", "name": result.name, "tool_call_id": result.id,
                                 "content": json.dumps(result.response or {})})
            elif part.text is not None:
                texts.append(part.text)
            else:
                raise ApiError("invalid_request", f"contents[{turn}].parts[{i}]: only text, functionCall and "
                                                  "functionResponse parts are supported", "contents")
        if texts or calls:
            messages.append({"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    return messages


def _tools(body: GenerateRequest) -> dict[str, Any]:
    declared = [{"name": f.name, "description": f.description,
                 "parameters": f.parametersJsonSchema or json_schema(f.parameters) or {"type": "object"}}
                for tool in body.tools or [] for f in tool.functionDeclarations or []]
    config = body.toolConfig.functionCallingConfig if body.toolConfig else None
    mode = (config.mode if config else None) or "AUTO"
    if mode == "NONE" or not declared:
        return {"tools": [], "tool_choice": "none"}
    if mode in ("ANY", "VALIDATED"):
        allowed = set(config.allowedFunctionNames or [f["name"] for f in declared])
        declared = [f for f in declared if f["name"] in allowed]
        if not declared:
            raise ApiError("invalid_request", "allowedFunctionNames names none of the declared functions",
                           "toolConfig")
        return {"tools": declared, "tool_choice": "required"}
    return {"tools": declared, "tool_choice": "auto"}


def _format(config: GenerationConfig) -> dict[str, Any] | None:
    if config.responseMimeType not in (None, "text/plain", "application/json"):
        raise ApiError("invalid_request", f"responseMimeType {config.responseMimeType!r} is not supported "
                                          "(text/plain or application/json)", "generationConfig.responseMimeType")
    if config.responseJsonSchema is not None:
        return {"type": "json_schema", "schema": config.responseJsonSchema}
    if config.responseSchema is not None:
        return {"type": "json_schema", "schema": json_schema(config.responseSchema)}
    return {"type": "json"} if config.responseMimeType == "application/json" else None


def generate_input(body: GenerateRequest) -> dict[str, Any]:
    config = body.generationConfig or GenerationConfig()
    return {"messages": _contents(body.contents, body.systemInstruction), **_tools(body),
            "max_tokens": config.maxOutputTokens, "temperature": config.temperature, "top_p": config.topP,
            "top_k": config.topK or None, "stop": config.stopSequences, "n": config.candidateCount or 1,
            "seed": config.seed, "presence_penalty": config.presencePenalty,
            "frequency_penalty": config.frequencyPenalty, "response_format": _format(config)}


# ---- results -> GenerateContentResponse --------------------------------------------------------

def _usage(u: dict[str, Any]) -> dict[str, int]:
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"promptTokenCount": prompt, "candidatesTokenCount": completion, "totalTokenCount": prompt + completion,
            "cachedContentTokenCount": int(u.get("cached_tokens") or 0)}


def _function_call(call: dict) -> dict[str, Any]:
    return {"functionCall": {"id": call["id"], "name": call["name"], "args": json.loads(call["arguments"])}}


def _candidate(index: int, parts: list, finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "content": {"role": "model", "parts": parts},
            **({"finishReason": finish} if finish else {})}


class _Reply:
    def __init__(self, model: str) -> None:
        self.model, self.id = model, secrets.token_hex(12)

    def response(self, candidates: list, usage: dict | None = None) -> dict[str, Any]:
        return {"candidates": candidates, **({"usageMetadata": _usage(usage)} if usage is not None else {}),
                "modelVersion": self.model, "responseId": self.id}


def generate_response(result: dict, reply: _Reply) -> dict[str, Any]:
    candidates = []
    for c in result["choices"]:
        parts = ([{"text": c["thinking"], "thought": True}] if c.get("thinking") else [])
        text = (c.get("text") or "") + (c.get("cut_call") or {}).get("text", "")    # a cut call: no valid args
        parts += [{"text": text}] if text or not c.get("tool_calls") else []
        parts += [_function_call(call) for call in c.get("tool_calls") or []]
        candidates.append(_candidate(c["index"], parts, FINISH.get(c.get("finish_reason"), "STOP")))
    return reply.response(candidates, result.get("usage") or {})


async def _chunks(call: Call, reply: _Reply) -> AsyncIterator[dict]:
    """A response per message; the finish reasons and the usage come in the last one."""
    finished: dict[int, str] = {}
    async for m in call.messages():
        kind, index = m.get("type"), m.get("choice", 0)
        if kind in ("text", "cut_call") and m["text"]:
            yield reply.response([_candidate(index, [{"text": m["text"]}])])
        elif kind == "thinking":
            yield reply.response([_candidate(index, [{"text": m["text"], "thought": True}])])
        elif kind == "tool_call":
            yield reply.response([_candidate(index, [_function_call(m)])])
        elif kind == "finish":
            finished[index] = FINISH.get(m.get("reason"), "STOP")
    yield reply.response([_candidate(i, [{"text": ""}], reason) for i, reason in sorted(finished.items())],
                         call.usage)


async def _events(responses: AsyncIterator[dict]) -> AsyncIterator[str]:
    """?alt=sse: each response a server-sent event."""
    async for response in responses:
        yield frame(response)


async def _array(responses: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Without alt=sse, as Google's API streams: one JSON array, each response an item written as it
    comes; an error ends the array as its last item."""
    separator = "["
    try:
        async for response in responses:
            yield separator + json.dumps(response, ensure_ascii=False)
            separator = ",\r\n"
    except ApiError as e:
        yield separator + json.dumps(_shape(e)[1], ensure_ascii=False)
        separator = ""
    yield ("[" if separator == "[" else "") + "]"


# ---- handlers ----------------------------------------------------------------------------------

def _model(serving: Serving, request: Request) -> str:
    return serving.check_model(request.path_params["model"].removeprefix("models/"))


async def generate_content(serving: Serving, request: Request, body: GenerateRequest) -> Response:
    reply = _Reply(_model(serving, request))
    stream = request.url.path.endswith(":streamGenerateContent")
    sse = request.query_params.get("alt") == "sse"
    return await answer(serving, request, GEMINI_GENERATE, generate_input(body), stream,
                        lambda result: generate_response(result, reply),
                        lambda call, start: (_events if sse else _array)(_chunks(call, reply)), API,
                        media_type=SSE if sse else "application/json; charset=UTF-8",
                        written={"max_tokens": "generationConfig.maxOutputTokens"})


async def count_tokens(serving: Serving, request: Request, body: CountRequest) -> Response:
    _model(serving, request)
    inner = body.generateContentRequest
    if (body.contents is None) == (inner is None):
        raise ApiError("invalid_request", "give either contents or generateContentRequest", "contents")
    input = {"messages": _contents(body.contents, None)} if inner is None else \
        {"messages": _contents(inner.contents, inner.systemInstruction), **_tools(inner)}
    result = await count(serving, request, GEMINI_COUNT, input)
    return JSONResponse({"totalTokens": result["prompt_tokens"]})


ROUTES = [route for prefix in ("/v1beta", "/v1", "") for route in (
    Route("POST", prefix + "/models/{model}:generateContent", API, generate_content,
          "Gemini generateContent.", GenerateRequest, query=("key",)),
    Route("POST", prefix + "/models/{model}:streamGenerateContent", API, generate_content,
          "Gemini streamGenerateContent: server-sent events with alt=sse, else a streamed JSON array.",
          GenerateRequest, streams=True,
          query=("alt", "key")),
    Route("POST", prefix + "/models/{model}:countTokens", API, count_tokens, "Gemini countTokens.", CountRequest,
          query=("key",)),
)]
