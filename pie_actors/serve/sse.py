"""Server-sent events: the frame format, and a response that streams frames until the client leaves.

A client that disconnects mid-stream cancels the stream and runs its `on_close` (which ends the
endpoint inferlet, so its KV pages return), whether the stream was waiting on the inferlet or
writing to the socket."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from .errors import ApiError

__all__ = ["frame", "EventStream", "SSE", "disconnected"]


def frame(data: Any, event: str | None = None) -> str:
    """One SSE frame: `data` as compact JSON (or as is, for a string), after its event name."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


async def disconnected(receive: Callable) -> None:
    """Returns once the client has gone (the request body is read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


SSE = "text/event-stream; charset=utf-8"


class EventStream:
    """An ASGI response: status 200 and `frames` as they come, as text/event-stream (or another
    streamed `media_type`). An ApiError raised by the frames becomes the API's `error_frame`;
    `on_close` runs however the stream ends."""

    def __init__(self, frames: AsyncIterator[str], error_frame: Callable[[ApiError], str],
                 on_close: Callable[[], None], media_type: str = SSE) -> None:
        self.frames, self.error_frame, self.on_close, self.media_type = frames, error_frame, on_close, media_type

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", self.media_type.encode()),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            try:
                async for text in self.frames:
                    await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
            except ApiError as e:
                await send({"type": "http.response.body", "body": self.error_frame(e).encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        streaming, watching = asyncio.ensure_future(pump()), asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            streaming.cancel()
            watching.cancel()
            self.on_close()
        error = streaming.exception() if streaming.done() and not streaming.cancelled() else None
        if error is not None and not isinstance(error, OSError):     # OSError: the client left as we wrote
            raise error
