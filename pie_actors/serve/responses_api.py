"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes the neutral input of endpoints/chat.py, as a chat completion does; its messages
become the Responses stream's events (response.created, response.in_progress, then per output
item output_item.added, content_part.added, output_text.delta..., output_text.done,
content_part.done, output_item.done, or a function call's arguments events, and response.completed
or response.incomplete), and its result the response object.

A stored response (store: true, the default) keeps its conversation alive for the key that made it:
the endpoint saves the reply's working set under the response's id (ws.save, scoped by the key's
owner) and the server keeps the conversation's messages. A request with `previous_response_id`
continues that conversation: the endpoint reopens the set (WorkingSet.open) and computes only the
new turn's tokens (usage.input_tokens_details.cached_tokens counts the rest). When the set is gone
(deleted, or evicted without a trace), the kept messages are computed again, with the same output.
As in OpenAI's API, `instructions` do not carry over from the previous response. The store is
bounded by `[serve] stored_responses`: the oldest responses go first, with their saved sets.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import secrets
import time
from contextlib import suppress
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import openai_api
from .errors import ApiError
from .inferlets import Call
from .routes import Api, Flag, Route, Serving, Shape, Strict, answer
from .sse import frame
from .stored import StoredResponse

__all__ = ["ROUTES", "ResponseRequest"]

KEY = "/v1/responses"                       # the endpoint key (serve.routes may map it to a program)


class MissingResponse(ApiError):
    """A response this key cannot see: `code` is the Responses API's code for it."""

    def __init__(self, kind: str, message: str, param: str | None, code: str | None) -> None:
        super().__init__(kind, message, param)
        self.code = code


def _shape(error: ApiError) -> tuple[int, dict]:
    status, body = openai_api.API.shape(error)
    if isinstance(error, MissingResponse):
        body["error"]["code"] = error.code
    return status, body


API = Api("openai", _shape, error_event="error")


# ---- request shapes ----------------------------------------------------------------------------

class ContentPart(Shape):
    type: str
    text: Optional[str] = None


class InputItem(Shape):
    """A message (role and content), a function_call the model made, or a function_call_output."""
    type: Optional[str] = None                  # "message" when a role is given
    role: Optional[Literal["user", "system", "developer", "assistant"]] = None
    content: Union[str, list[ContentPart], None] = None
    call_id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None
    output: Union[str, list[ContentPart], None] = None


class FunctionTool(Shape):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[Flag] = None


class NamedFunction(Shape):
    type: Literal["function"]
    name: str


class PlainFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[Flag] = None


class TextConfig(Shape):
    format: Optional[Annotated[Union[PlainFormat, JsonObjectFormat, JsonSchemaFormat],
                               Field(discriminator="type")]] = None


class ResponseRequest(Strict):
    """A field OpenAI's Responses API does not have, or one this server does not implement, is
    refused by name; those that only label a request for its owner are taken without effect."""
    not_implemented = frozenset({"access_programs", "background", "background_options", "context_management",
                                 "conversation", "image", "include", "max_tool_calls", "moderation", "prompt",
                                 "prompt_cache_options", "prompt_cache_retention", "reasoning", "stream_options",
                                 "top_logprobs", "truncation"})
    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    stream: Flag = False
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: Optional[Flag] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    store: Flag = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None


# ---- requests -> the endpoint's input ----------------------------------------------------------

def _text(content: Union[str, list[ContentPart], None], where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise ApiError("invalid_request", f"{where}: only text content parts are supported, not {part.type!r}",
                           where)
    return "\n".join(part.text for part in content)


def conversation(history: list[dict], input: Union[str, list[InputItem]]) -> list[dict[str, Any]]:
    """`history` (the stored conversation this request continues) and `input` as the endpoint's
    messages: function calls join the assistant message before them, their outputs are tool
    messages."""
    if isinstance(input, str):
        return [*history, {"role": "user", "content": input}]
    messages = list(history)
    for i, item in enumerate(input):
        kind, where = item.type or ("message" if item.role else None), f"input.{i}"
        if kind == "message" and item.role is not None:
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content, where)})
        elif kind == "function_call" and item.call_id and item.name:
            call = {"id": item.call_id, "name": item.name, "arguments": item.arguments or "{}"}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1] = {**messages[-1], "tool_calls": [*messages[-1].get("tool_calls", []), call]}
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and item.call_id:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, where)})
        else:
            raise ApiError("invalid_request", f"{where}: an item is a message (role, content), a function_call "
                                              "(call_id, name, arguments) or a function_call_output (call_id, "
                                              f"output); got type {kind!r}", where)
    return messages


def _format(text: Optional[TextConfig]) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":      # OpenAI's JSON mode: the reply is a JSON object
        return {"type": "json_schema", "schema": {"type": "object"}}
    if fmt.schema_ is None:
        raise ApiError("invalid_request", "text.format json_schema needs a schema", "text.format.schema")
    return {"type": "json_schema", "schema": fmt.schema_}


def endpoint_input(body: ResponseRequest, messages: list[dict], resume: dict | None, save: str | None) -> dict:
    choice = body.tool_choice
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return {"messages": instructions + messages, "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [{"name": t.name, "description": t.description, "parameters": t.parameters}
                      for t in body.tools or []],
            "tool_choice": {"name": choice.name} if isinstance(choice, NamedFunction) else choice,
            "parallel_tool_calls": body.parallel_tool_calls, "response_format": _format(body.text),
            "resume": resume, "save": save}


# ---- the endpoint's messages -> output items and stream events ---------------------------------

def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class Output:
    """A response's output items, built from the endpoint's reply as it comes: text (one message
    item with one output_text part) and function calls (an item each). Each step returns the
    stream events it makes, without their sequence numbers."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None      # the message item being written

    def text(self, delta: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}
            self.items.append(self._message)
            events.append(self._item_event("response.output_item.added", self._message))
            self._message["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self._part_event("response.content_part.added"))
        if delta:
            self._message["content"][0]["text"] += delta
            events.append({"type": "response.output_text.delta", **self._where(), "delta": delta, "logprobs": []})
        return events

    def call(self, call: dict[str, Any], status: str = "completed") -> list[dict[str, Any]]:
        """A function call item; "incomplete" for one the length cut off (its arguments so far)."""
        events = self._end_message("completed")
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                "name": call["name"], "arguments": ""}
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events.append(self._item_event("response.output_item.added", item))
        item["arguments"], item["status"] = call["arguments"], status
        events += [{"type": "response.function_call_arguments.delta", **where, "delta": call["arguments"]},
                   {"type": "response.function_call_arguments.done", **where, "name": call["name"],
                    "arguments": call["arguments"]},
                   self._item_event("response.output_item.done", item)]
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """The end of the reply (`status`: "completed" or "incomplete"); a reply of no text and no
        call still has its (empty) message."""
        events = self.text("") if not self.items else []
        return events + self._end_message(status)

    def _end_message(self, status: str) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        part = self._message["content"][0]
        events = [{"type": "response.output_text.done", **self._where(), "text": part["text"], "logprobs": []},
                  self._part_event("response.content_part.done")]
        self._message["status"] = status
        events.append(self._item_event("response.output_item.done", self._message))
        self._message = None
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._message["id"], "output_index": self.items.index(self._message), "content_index": 0}

    def _part_event(self, kind: str) -> dict[str, Any]:
        return {"type": kind, **self._where(), "part": copy.deepcopy(self._message["content"][0])}

    def _item_event(self, kind: str, item: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, "output_index": self.items.index(item), "item": copy.deepcopy(item)}

    def message(self) -> dict[str, Any]:
        """The output as the endpoint's assistant message, for the stored conversation."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "name": i["name"], "arguments": i["arguments"]}   # a cut one is not JSON
                 for i in self.items if i["type"] == "function_call" and i["status"] == "completed"]
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def usage(u: dict[str, Any]) -> dict[str, Any]:
    chat = openai_api.usage(u)
    # nothing is written to a provider's paid cache here: the prefix cache keeps pages on its own
    details = {**chat["prompt_tokens_details"], "cache_write_tokens": 0}
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": details,
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


class Reply:
    """One response being made: its id, the request, the conversation it continues, its output."""

    def __init__(self, serving: Serving, request: Request, body: ResponseRequest) -> None:
        self.serving, self.body = serving, body
        self.owner: str | None = request.state.owner
        self.id, self.created = _id("resp"), int(time.time())
        self.model = serving.check_model(body.model) if body.model is not None else serving.names[0]
        self.history: list[dict] = []
        self.resume: dict | None = None
        if body.previous_response_id is not None:
            previous = serving.responses.get(self.owner, body.previous_response_id)
            if previous is None:
                raise MissingResponse("invalid_request", f"Previous response with id "
                                      f"{body.previous_response_id!r} not found.", "previous_response_id",
                                      "previous_response_not_found")
            self.history, self.resume = previous.messages, previous.saved
        self.messages = conversation(self.history, body.input)
        self.output = Output()

    def input(self) -> dict[str, Any]:
        return endpoint_input(self.body, self.messages, self.resume, self.id if self.body.store else None)

    def object(self, status: str, usage: dict | None = None, incomplete: dict | None = None) -> dict[str, Any]:
        body, choice = self.body, self.body.tool_choice
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": self.model,
                "output": copy.deepcopy(self.output.items), "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": body.store, "temperature": 1.0 if body.temperature is None else body.temperature,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
                "usage": usage, "user": body.user, "metadata": body.metadata or {}}

    def finish(self, result: dict[str, Any]) -> tuple[list[dict], dict[str, Any]]:
        """The endpoint's result: the stream's closing events and the response object (stored,
        when asked for)."""
        cut = result["choices"][0].get("finish_reason") == "length"
        events = self.output.close("incomplete" if cut else "completed")
        response = self.object("incomplete" if cut else "completed", usage(result.get("usage") or {}),
                               {"reason": "max_output_tokens"} if cut else None)
        if self.body.store:
            stored = StoredResponse(self.owner, response, [*self.messages, self.output.message()], result.get("saved"))
            for dropped in self.serving.responses.put(self.id, stored):
                _background(forget(self.serving, dropped))
        return events, response

    def respond(self, result: dict[str, Any]) -> dict[str, Any]:
        choice = result["choices"][0]
        self.output.text(choice.get("text") or "")
        for call in choice.get("tool_calls") or []:
            self.output.call(call)
        if choice.get("cut_call"):
            self._cut(choice["cut_call"])
        return self.finish(result)[1]

    def _cut(self, cut: dict[str, Any]) -> list[dict[str, Any]]:
        """A call the length cut off: an incomplete function_call item once its name is known, else text."""
        return self.output.call(cut, "incomplete") if cut.get("name") is not None else self.output.text(cut["text"])

    async def events(self, call: Call, start: dict) -> AsyncIterator[str]:
        numbers = itertools.count()

        def sse(event: dict[str, Any]) -> str:
            return frame({**event, "sequence_number": next(numbers)}, event["type"])

        yield sse({"type": "response.created", "response": self.object("in_progress")})
        yield sse({"type": "response.in_progress", "response": self.object("in_progress")})
        async for message in call.messages():
            kind = message.get("type")
            made = (self.output.text(message["text"]) if kind == "text" and message.get("text") else
                    self.output.call(message) if kind == "tool_call" else
                    self._cut(message) if kind == "cut_call" else [])
            for event in made:
                yield sse(event)
        closing, response = self.finish(call.result)
        for event in closing:
            yield sse(event)
        yield sse({"type": f"response.{response['status']}", "response": response})

    def closed(self, call: Call) -> None:
        """The request is over: a response that was to be kept but was not (its client left, or it
        failed) leaves no saved working set behind, once its inferlet has ended."""
        call.close()
        if self.body.store and self.serving.responses.get(self.owner, self.id) is None:
            _background(_forget_after(self.serving, call, self.owner, self.id))


# ---- the saved working sets of responses no longer kept ----------------------------------------

_tasks: set[asyncio.Task] = set()


def _background(work) -> None:
    task = asyncio.ensure_future(work)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


async def _delete_saved(serving: Serving, owner: str | None, name: str) -> None:
    if serving.runtime is not None:
        with suppress(KeyError):
            await asyncio.to_thread(serving.runtime.delete_saved, name, owner)


async def forget(serving: Serving, stored: StoredResponse) -> None:
    """Delete a dropped response's saved working set (gone already: nothing to do)."""
    if stored.saved is not None:
        await _delete_saved(serving, stored.owner, stored.saved["name"])


async def _forget_after(serving: Serving, call: Call, owner: str | None, name: str) -> None:
    async for _ in call.process.aevents():         # nothing saves once the run has ended
        pass
    await _delete_saved(serving, owner, name)


# ---- handlers ----------------------------------------------------------------------------------

async def create(serving: Serving, request: Request, body: ResponseRequest) -> Response:
    reply = Reply(serving, request, body)
    return await answer(serving, request, KEY, reply.input(), body.stream, reply.respond, reply.events, API,
                        closed=reply.closed, written={"max_tokens": "max_output_tokens"})


def _stored(serving: Serving, request: Request) -> tuple[str, StoredResponse | None]:
    response_id = request.path_params["response_id"]
    return response_id, serving.responses.get(request.state.owner, response_id)


def _missing(response_id: str) -> MissingResponse:
    return MissingResponse("not_found", f"Response with id {response_id!r} not found.", None, None)


async def retrieve(serving: Serving, request: Request, body: None) -> Response:
    response_id, stored = _stored(serving, request)
    if stored is None:
        raise _missing(response_id)
    return JSONResponse(stored.response)


async def delete(serving: Serving, request: Request, body: None) -> Response:
    response_id, stored = _stored(serving, request)
    if stored is None:
        raise _missing(response_id)
    serving.responses.pop(stored.owner, response_id)
    await forget(serving, stored)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


ROUTES = [
    Route("POST", "/v1/responses", API, create, "A model response (streamed with stream: true); previous_response_id "
          "continues a stored one's conversation from its saved working set.", ResponseRequest, streams=True),
    Route("GET", "/v1/responses/{response_id}", API, retrieve, "A stored response."),
    Route("DELETE", "/v1/responses/{response_id}", API, delete, "Delete a stored response and its saved working set."),
]
