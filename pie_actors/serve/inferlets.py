"""The inferlets behind the routes: which program serves each one, launching it through the runtime,
and reading a launched one (`Call`) as the neutral protocol of endpoints/chat.py.

Every route that generates or counts tokens names an endpoint key (a route path; the Gemini routes
share theirs); the config's `serve.routes` maps a key to a user's program in place of the built-in
one. A program that sends plain text instead of the protocol's JSON messages streams it as reply
text, and one that returns no "choices" has its "text" taken as the reply.
"""
from __future__ import annotations

import asyncio
import json
import time
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping

from ..process import Done, Failed, Process, Send
from ..program import Program
from .errors import ApiError
from .metrics import Metrics
from .quotas import Quotas
from .sse import disconnected

__all__ = ["Endpoints", "Call", "ClientGone", "ENDPOINT_KEYS", "GEMINI_GENERATE", "GEMINI_COUNT"]

ENDPOINTS = Path(__file__).resolve().parent / "endpoints"
CHAT, DETOKENIZE = ENDPOINTS / "chat.py", ENDPOINTS / "detokenize.py"
GEMINI_GENERATE, GEMINI_COUNT = "/v1beta/models/{model}:generateContent", "/v1beta/models/{model}:countTokens"
# endpoint key -> the built-in program
ENDPOINT_KEYS: dict[str, Path] = {
    "/v1/chat/completions": CHAT, "/v1/completions": CHAT, "/v1/responses": CHAT, "/v1/messages": CHAT,
    "/v1/messages/count_tokens": CHAT, GEMINI_GENERATE: CHAT, GEMINI_COUNT: CHAT,
    "/tokenize": CHAT, "/detokenize": DETOKENIZE,
}
REFUSALS = {"invalid_request", "context_length_exceeded"}     # the error types an endpoint may return


# Engine refusals for want of KV pages: the request may succeed later (or smaller), so the client
# gets a 429 in its API's shape, not a 500 (OpenAI answers an overloaded engine with 429 too).
BUSY = {"QuotaExceeded": "quota exceeded (kv_pages)",
        "OutOfPages": "the engine's KV cache has no room for this request now (retry later, or ask for fewer "
                      "tokens or choices)"}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Endpoints:
    """The program for each endpoint key (a bad `routes` entry is a ValueError at once), launched on
    `runtime` for each request once it is set, within the key's `quotas`."""

    def __init__(self, routes: Mapping[str, str], metrics: Metrics, quotas: Quotas) -> None:
        unknown = sorted(set(routes) - set(ENDPOINT_KEYS))
        if unknown:
            raise ValueError(f"serve.routes: no endpoint route {', '.join(unknown)}; the routes are "
                             f"{', '.join(ENDPOINT_KEYS)}")
        loaded = {path: Program.load(path) for path in set(ENDPOINT_KEYS.values())}
        self.programs = {key: loaded[path] for key, path in ENDPOINT_KEYS.items()}
        self.programs.update({key: Program.load(Path(path).expanduser()) for key, path in routes.items()})
        self.metrics, self.quotas = metrics, quotas
        self.runtime: Any = None

    async def launch(self, key: str, input: dict[str, Any], owner: str | None = None) -> Call:
        """Launch endpoint `key` on `input`, as `owner`'s process (the saved working sets it
        opens and saves, and the prefix cache it hits, are that owner's); over one of the owner's
        quotas, an ApiError("rate_limited")."""
        arrived = time.monotonic()
        limits = self.quotas.limits(owner, self.runtime.config.limits)
        launch = partial(self.runtime.launch, self.programs[key], input, owner=owner, limits=limits)
        with self.quotas.launching(owner):
            process = await asyncio.get_running_loop().run_in_executor(None, launch)
        return Call(process, arrived, self.metrics, partial(self.quotas.used, owner))


class Call:
    """A launched endpoint inferlet. Read it one way: `start` then `messages` (a stream), or
    `finish` (the whole result); `result` holds main's output once it has ended."""

    def __init__(self, process: Process, arrived: float, metrics: Metrics,
                 used: Callable[[int], None] = lambda tokens: None) -> None:
        self.process, self.arrived, self.metrics, self.used = process, arrived, metrics, used
        self._events = process.aevents()
        self._early: list[dict] = []                # messages read ahead by `start`
        self.result: dict[str, Any] | None = None
        self.first_output: float | None = None

    async def _next(self) -> dict[str, Any] | None:
        """The next message; None once the run has ended (`result` is then set, or an ApiError raised)."""
        async for event in self._events:
            if isinstance(event, Send):
                message = _message(event.text)
                if self.first_output is None and message.get("type") in ("text", "thinking", "tool_call"):
                    self.first_output = time.monotonic()
                return message
            if isinstance(event, Done):
                self.result = _result(event.output)
                self._record()
                return None
            if isinstance(event, Failed):
                for refusal, says in BUSY.items():
                    if refusal in event.message:
                        raise ApiError("rate_limited", f"{says}: {event.message}")
                raise ApiError("server_error", f"the endpoint inferlet failed ({event.kind}): {event.message}")
        return None

    async def start(self) -> dict[str, Any]:
        """Waits for the start message (prompt_tokens, cached_tokens), or for the run to end: a
        refusal or failure before any output is raised as an ApiError, so the client gets an error
        response instead of a stream."""
        message = await self._next()
        if message is None:
            return {"prompt_tokens": self.usage.get("prompt_tokens", 0),
                    "cached_tokens": self.usage.get("cached_tokens", 0)}
        if message.get("type") == "start":
            return message
        self._early.append(message)
        return {"prompt_tokens": 0, "cached_tokens": 0}

    async def messages(self) -> AsyncIterator[dict[str, Any]]:
        """The messages after `start`, until the run ends."""
        while self._early:
            yield self._early.pop(0)
        while (message := await self._next()) is not None:
            yield message

    async def finish(self, receive: Callable) -> dict[str, Any]:
        """The result, skipping the messages. Raises ClientGone (and ends the inferlet) when the
        client disconnects first."""
        async def drain() -> dict[str, Any]:
            async for _ in self.messages():
                pass
            return self.result

        reading, watching = asyncio.ensure_future(drain()), asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({reading, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            gone = not reading.done()        # a cancelled task is done only once it has run again
            if gone:
                reading.cancel()
                self.close()
        if gone:
            raise ClientGone()
        return reading.result()

    @property
    def usage(self) -> dict[str, int]:
        return (self.result or {}).get("usage") or {}

    def close(self) -> None:
        """End the inferlet if it still runs (its KV pages return)."""
        if not self.process.ended:
            self.process.kill()

    def _record(self) -> None:
        now = time.monotonic()
        ttft = tpot = None
        if self.first_output is not None:
            ttft = self.first_output - self.arrived
            later = int(self.usage.get("completion_tokens") or 0) - 1
            tpot = (now - self.first_output) / later if later > 0 else None
        self.metrics.generation(self.usage, now - self.arrived, ttft, tpot)
        self.used(int(self.usage.get("prompt_tokens") or 0) + int(self.usage.get("completion_tokens") or 0))


def _message(text: str) -> dict[str, Any]:
    try:
        message = json.loads(text)
    except ValueError:
        message = None
    return message if isinstance(message, dict) and "type" in message else {"type": "text", "choice": 0, "text": text}


def _result(output: Any) -> dict[str, Any]:
    """Main's output as the protocol's result; a refusal raised as its ApiError."""
    if not isinstance(output, dict):
        output = {"text": "" if output is None else str(output)}
    error = output.get("error")
    if error is not None:
        error = error if isinstance(error, dict) else {"message": str(error)}
        kind = error.get("type") if error.get("type") in REFUSALS else "invalid_request"
        raise ApiError(kind, str(error.get("message", "the endpoint refused the request")), error.get("param"))
    if "choices" not in output and "prompt_tokens" not in output and "text" in output:
        output = {"choices": [{"index": 0, "text": str(output["text"]), "finish_reason": "stop"}], "usage": {}}
    return output
