"""What an API module declares, and the request flow its routes share.

An API module (openai_api, anthropic_api, gemini_api) has an `Api` (how it writes errors) and a list
of `Route`s. A generating route's handler checks the request's shape (a pydantic model: `parse`),
turns it into the endpoint inferlet's input and hands it to `answer`, which launches the inferlet
and turns its result, or its messages as they come, into the response.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar, Mapping

from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import ApiError
from .inferlets import Call, ClientGone, Endpoints
from .metrics import Metrics
from .quotas import Quotas
from .sessions import Sessions
from .stored import StoredResponses
from .sse import SSE, EventStream, frame

__all__ = ["Api", "Route", "Serving", "Shape", "Strict", "Flag", "parse", "answer", "count"]

CLIENT_CLOSED = 499          # what the log and metrics say of a request whose client left first


# A request's boolean: true or false only, as the APIs take them ("yes" or 1 is refused, not read as true)
Flag = StrictBool


class Shape(BaseModel):
    """A request shape: the fields a route reads, checked; fields it does not know are ignored
    (clients send more than a server needs)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Strict(Shape):
    """A request shape whose unknown fields are refused (as OpenAI refuses them), each named in
    the error: "Unrecognized request argument supplied: <name>"; a field of the real API that this
    server does not implement (`not_implemented`) as OpenAI refuses a parameter a model lacks:
    "Unsupported parameter: '<name>' is not supported by this server"."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    not_implemented: ClassVar[frozenset[str]] = frozenset()


@dataclass(frozen=True)
class Api:
    """How one API writes an error: `shape(error)` -> (status, body); in a stream the body is a
    frame (named `error_event`, where the API names its events)."""

    name: str
    shape: Callable[[ApiError], tuple[int, dict]]
    error_event: str | None = None

    def error_response(self, error: ApiError) -> JSONResponse:
        status, body = self.shape(error)
        return JSONResponse(body, status_code=status)


    def error_frame(self, error: ApiError) -> str:
        return frame(self.shape(error)[1], self.error_event)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    api: Api
    handler: Callable[..., Awaitable[Response]]   # (serving, request, body) -> response
    summary: str
    body: type[BaseModel] | None = None           # the request's shape
    streams: bool = False                         # may answer text/event-stream
    engine: bool = True                           # needs the engine (503 while it loads)
    public: bool = False                          # needs no key
    query: tuple[str, ...] = ()                   # documented query parameters


@dataclass
class Serving:
    """What the handlers share: the model's names, its endpoints (None while the engine loads),
    the runtime, the metrics, the processes launched over the WebSocket, the responses stored
    by /v1/responses, and the keys' quotas."""

    model: str
    names: tuple[str, ...]
    metrics: Metrics
    sessions: Sessions
    runtime: Any = None
    endpoints: Endpoints | None = None
    loading_error: str | None = field(default=None)
    responses: StoredResponses = field(default_factory=StoredResponses)
    quotas: Quotas = field(default_factory=lambda: Quotas({}))
    default_max_tokens: int = 1024              # a reply's bound when its request gives none ([serve])

    def check_model(self, name: str) -> str:
        """`name` if the model answers to it; else an ApiError("not_found")."""
        if name not in self.names:
            raise ApiError("not_found", f"the model {name!r} does not exist; this server serves "
                                        f"{', '.join(map(repr, self.names))}", "model")
        return name


async def parse(request: Request, shape: type[BaseModel]) -> BaseModel:
    """The request's JSON body as `shape`; a body that is not JSON, or not that shape, is an
    ApiError naming the first bad field."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except ValueError as e:
        raise ApiError("invalid_request", f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError("invalid_request", "the request body must be a JSON object")
    try:
        return shape.model_validate(data)
    except ValidationError as e:
        unknown = [".".join(map(str, _user_path(error["loc"], data, False))) for error in e.errors()
                   if error["type"] == "extra_forbidden"]
        if unknown:
            name = unknown[0]
            message = (f"Unsupported parameter: '{name}' is not supported by this server"
                       if name in getattr(shape, "not_implemented", ()) else
                       f"Unrecognized request argument supplied: {name}")
            raise ApiError("invalid_request", message, name) from None
        where, message = _first_error(e.errors(), data)
        raise ApiError("invalid_request", f"{where}: {message}" if where else message, where or None) from None


def _user_path(loc: tuple, data: Any, missing: bool) -> tuple:
    """`loc` without the names pydantic gives the members of a union ("str", "list[str]"), which
    the user never wrote: only the keys and indexes found in `data` are kept (and, for a missing
    field, its name)."""
    path = []
    for i, step in enumerate(loc):
        if isinstance(data, dict) and step in data:
            data = data[step]
        elif isinstance(data, list) and isinstance(step, int) and 0 <= step < len(data):
            data = data[step]
        elif not (missing and i == len(loc) - 1):
            continue
        path.append(step)
    return tuple(path)


def _mismatch(error: dict) -> bool:
    return error["type"].endswith("_type") or error["type"] == "literal_error"


def _first_error(errors: list[dict], data: Any) -> tuple[str, str]:
    """The field and message to report: the error deepest in the user's data (a union's member that
    got furthest), a value's error before a wrong type; where only wrong types are left at that
    field (a union none of whose members fit), their messages together."""
    found = [(_user_path(e["loc"], data, e["type"] == "missing"), e) for e in errors]
    depth = max(len(path) for path, _ in found)
    deepest = [(path, e) for path, e in found if len(path) == depth]
    path, error = next(((p, e) for p, e in deepest if not _mismatch(e)), deepest[0])
    message = error["msg"]
    if _mismatch(error):
        said = list(dict.fromkeys(e["msg"] for p, e in deepest if p == path))
        lead = "Input should be "
        message = lead + " or ".join(m.removeprefix(lead) for m in said) if all(
            m.startswith(lead) for m in said) else "; ".join(said)
    return ".".join(str(p) for p in path), message


async def answer(serving: Serving, request: Request, key: str, input: dict[str, Any], stream: bool,
                 respond: Callable[[dict], dict], frames: Callable[[Call, dict], AsyncIterator[str]],
                 api: Api, closed: Callable[[Call], None] = Call.close, media_type: str = SSE,
                 written: Mapping[str, str] = MappingProxyType({})) -> Response:
    """Launch endpoint `key` on `input` as the process of the request's owner (its key). Not
    streaming: `respond(result)` once it has ended. Streaming: wait for its start (a refusal is
    still an error response), then `frames(call, start)` (server-sent events, or `media_type`); a client that
    leaves ends the inferlet either way. `closed(call)` runs once the request is over, however it
    ended (default: end the inferlet). A request without max_tokens gets the server's default.
    `written` maps input fields to the names the request gave them (max_tokens ->
    max_completion_tokens): the endpoint's refusals name the field the user wrote."""
    try:
        return await _answer(serving, request, key, input, stream, respond, frames, api, closed, media_type)
    except ApiError as e:
        if e.param not in written:
            raise
        raise ApiError(e.kind, e.message.replace(e.param, written[e.param]), written[e.param]) from None


async def _answer(serving: Serving, request: Request, key: str, input: dict[str, Any], stream: bool,
                  respond: Callable[[dict], dict], frames: Callable[[Call, dict], AsyncIterator[str]],
                  api: Api, closed: Callable[[Call], None], media_type: str) -> Response:
    input = {**input, "stream": stream, "default_max_tokens": serving.default_max_tokens}
    call = await serving.endpoints.launch(key, input, request.state.owner)
    if not stream:
        try:
            return JSONResponse(respond(await call.finish(request.receive)))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            closed(call)
    try:
        start = await call.start()
    except BaseException:
        closed(call)
        raise
    return EventStream(frames(call, start), api.error_frame, lambda: closed(call), media_type)


async def count(serving: Serving, request: Request, key: str, input: dict[str, Any]) -> dict[str, Any]:
    """Launch endpoint `key` to count `input`'s prompt tokens, as the request owner's process: its
    result (prompt_tokens, tokens)."""
    call = await serving.endpoints.launch(key, {**input, "count_only": True, "stream": False}, request.state.owner)
    async for _ in call.messages():
        pass
    return call.result
