"""Calling tools over HTTP from an inferlet: `await http.fetch(url, ...)`.

The host makes the request (the inferlet's other tasks run meanwhile) within the run's guards: only
hosts of the config's allow-list (`[limits] allow_hosts`, or `pie run --allow-host HOST`), no private
or cluster addresses unless the host is listed by itself, a timeout and a response size limit. A
refused or failed request raises `HttpError`; its `kind` says which: "refused", "timeout",
"too_large" or "failed".

    response = await http.fetch("https://api.example.com/v1/search", method="POST",
                                headers={"content-type": "application/json"}, body=json.dumps(q))
    hits = response.json()
"""
from __future__ import annotations

import base64
import json as _json

from . import _host

__all__ = ["fetch", "Response", "HttpError"]

KINDS = ("refused", "timeout", "too_large", "failed")


class HttpError(Exception):
    """A request the host refused or could not complete; `kind` is one of KINDS."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Response:
    """What the server answered: `status`, `headers` (lower-case names; `header_list` keeps
    repeats), `url` (after redirects), `body` (bytes), and `text` / `json()`."""

    def __init__(self, raw: dict):
        self.status: int = raw["status"]
        self.url: str = raw["url"]
        self.header_list: list[tuple[str, str]] = [(k.lower(), v) for k, v in raw["headers"]]
        self.headers: dict[str, str] = dict(self.header_list)
        self.body: bytes = base64.b64decode(raw["body"])

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self):
        return _json.loads(self.body)

    def __repr__(self) -> str:
        return f"<Response {self.status} {self.url} {len(self.body)} bytes>"


def _error(e: _host.HostError) -> HttpError:
    text = str(e)
    if text.startswith("http.fetch: "):        # a refusal before the request went out
        text = text[len("http.fetch: "):]
    kind, _, message = text.partition(": ")
    return HttpError(kind, message) if kind in KINDS else HttpError("failed", text)


async def fetch(url: str, method: str = "GET", headers: dict | None = None, body=None,
                timeout: float = 10.0) -> Response:
    """Make an HTTP request; `body` is bytes or text (sent as UTF-8). `timeout`: seconds for the
    whole request, at most the config's `http_timeout_s`."""
    if isinstance(body, str):
        body = body.encode("utf-8")
    args = {"url": str(url), "method": method, "headers": dict(headers or {}), "timeout": timeout,
            "body": None if body is None else base64.b64encode(bytes(body)).decode("ascii")}
    try:
        return Response(await _host.call_async("http.fetch", args))
    except _host.HostError as e:
        raise _error(e) from None
