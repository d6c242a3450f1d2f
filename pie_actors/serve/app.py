"""The ASGI app of `pie serve`: the routes of every API on one Starlette app, behind the API keys,
with /health, /metrics and /openapi.json.

A client may present its key the way any of the APIs does: `Authorization: Bearer`, `x-api-key`,
`x-goog-api-key` or `?key=`. With keys set, every route but /health needs one.
"""
from __future__ import annotations

import hmac
import logging
from typing import Collection

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route as StarletteRoute

from . import anthropic_api, gemini_api, openai_api
from .errors import ApiError
from .openapi import document
from .routes import Route, Serving, parse

__all__ = ["build_app", "ROUTES"]

log = logging.getLogger("pie.serve")


async def health(serving: Serving, request: Request, body: None) -> Response:
    if serving.loading_error is not None:
        return JSONResponse({"status": "failed", "error": serving.loading_error}, status_code=503)
    if serving.endpoints is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok", "model": serving.model})


async def metrics(serving: Serving, request: Request, body: None) -> Response:
    stats = serving.runtime.stats() if serving.endpoints is not None else None
    return PlainTextResponse(serving.metrics.render(stats), media_type="text/plain; version=0.0.4")


async def openapi_json(serving: Serving, request: Request, body: None) -> Response:
    return JSONResponse(OPENAPI)


API = openai_api.API
SERVICE_ROUTES = [
    Route("GET", "/health", API, health, "200 once the engine serves, 503 while it loads.", engine=False, public=True),
    Route("GET", "/metrics", API, metrics, "Prometheus metrics: requests, tokens, TTFT/TPOT, KV pages, batches.",
          engine=False),
    Route("GET", "/openapi.json", API, openapi_json, "This document.", engine=False),
]
ROUTES: list[Route] = [*gemini_api.ROUTES, *openai_api.ROUTES, *anthropic_api.ROUTES, *SERVICE_ROUTES]
OPENAPI = document(ROUTES, "pie serve", "1")


def _presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return (request.headers.get("x-api-key") or request.headers.get("x-goog-api-key")
            or request.query_params.get("key"))


def _authenticate(request: Request, keys: Collection[str]) -> None:
    key = _presented_key(request)
    if not key:
        raise ApiError("missing_key", "this server needs an API key (Authorization: Bearer KEY, x-api-key, "
                                      "x-goog-api-key or ?key=)")
    if not any(hmac.compare_digest(key.encode(), k.encode()) for k in keys):
        raise ApiError("invalid_key", "the API key is not valid")


def _endpoint(route: Route, serving: Serving, keys: Collection[str]):
    async def handle(request: Request) -> Response:
        try:
            if keys and not route.public:
                _authenticate(request, keys)
            if route.engine and serving.endpoints is None:
                raise ApiError("unavailable", serving.loading_error or "the engine is still loading")
            body = await parse(request, route.body) if route.body is not None else None
            response = await route.handler(serving, request, body)
        except ApiError as e:
            response = route.api.error_response(e)
        except Exception as e:                 # a bug: answered in the API's shape, and the server goes on
            log.exception("%s %s failed", route.method, route.path)
            response = route.api.error_response(ApiError("server_error", f"{type(e).__name__}: {e}"))
        serving.metrics.request(route.path, getattr(response, "status_code", 200))
        return response
    return handle


def build_app(serving: Serving, api_keys: Collection[str]) -> Starlette:
    keys = tuple(api_keys)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return JSONResponse({"error": {"message": f"no route {request.method} {request.url.path}",
                                       "type": "invalid_request_error", "param": None, "code": None}},
                            status_code=status)

    return Starlette(routes=[StarletteRoute(r.path, _endpoint(r, serving, keys), methods=[r.method]) for r in ROUTES],
                     exception_handlers={404: not_found, 405: not_found})
