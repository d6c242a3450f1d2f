"""The ASGI app of `pie serve`: the routes of every API on one Starlette app, behind the API keys
(auth.py), with /health, /metrics and /openapi.json, the WebSocket of pie-client at /v1/ws
(ws.py), and the playground's page at / (playground/). With keys set, every route but /health and
the page's own files needs one.
"""
from __future__ import annotations

import logging
from typing import Collection

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route as StarletteRoute
from starlette.routing import WebSocketRoute

from ..gpu.engine.engine_process import EngineDown
from ..ws_protocol import PATH as WS_PATH
from . import anthropic_api, gemini_api, openai_api, playground, responses_api, ws
from .auth import check_key, owner_of, presented_key
from .errors import ApiError
from .openapi import document
from .routes import Api, Route, Serving, parse

__all__ = ["build_app", "api_of", "ROUTES"]

log = logging.getLogger("pie.serve")


async def health(serving: Serving, request: Request, body: None) -> Response:
    if serving.loading_error is not None:
        return JSONResponse({"status": "failed", "error": serving.loading_error}, status_code=503)
    if serving.endpoints is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    try:
        # an engine serves while its decode buckets compile: how far they are (wire.Stats "compile")
        compile = serving.runtime.stats()["compile"]
    except EngineDown as e:          # its process died (before this request, or since); another is starting
        return JSONResponse({"status": "restarting", "error": serving.runtime.engine_down or str(e)},
                            status_code=503)
    return JSONResponse({"status": "ok", "model": serving.model, "compile": compile})


async def metrics(serving: Serving, request: Request, body: None) -> Response:
    stats, restarts = None, 0
    if serving.endpoints is not None:
        restarts = serving.runtime.engine_restarts
        try:
            stats = serving.runtime.stats()
        except EngineDown:           # restarting: the server's own figures, and pie_engine_up 0
            pass
    return PlainTextResponse(serving.metrics.render(stats, restarts), media_type="text/plain; version=0.0.4")


async def openapi_json(serving: Serving, request: Request, body: None) -> Response:
    return JSONResponse(OPENAPI)


API = openai_api.API
SERVICE_ROUTES = [
    Route("GET", "/health", API, health, "200 once the engine serves (with its compiled decode buckets: ready, "
          "total, compiling, failed), 503 while it loads, and 503 'restarting' while another engine process "
          "starts after one died (pie serve --local).", engine=False, public=True),
    Route("GET", "/metrics", API, metrics, "Prometheus metrics: requests, tokens, TTFT/TPOT, KV pages, batches, "
          "whether the engine serves and its restarts.", engine=False),
    Route("GET", "/openapi.json", API, openapi_json, "This document.", engine=False),
]
ROUTES: list[Route] = [*gemini_api.ROUTES, *openai_api.ROUTES, *responses_api.ROUTES, *anthropic_api.ROUTES,
                       *SERVICE_ROUTES, *playground.ROUTES]
OPENAPI = document(ROUTES, "pie serve", "1")


def api_of(path: str) -> Api:
    """Whose API a path is under, for an error about a route the server lacks: Anthropic's under
    /v1/messages, Gemini's under /v1beta and for a model's methods (models/{model}:method), else OpenAI's."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return anthropic_api.API
    if path.startswith("/v1beta/") or ":" in path.rpartition("/models/")[2]:
        return gemini_api.API
    return API


def _endpoint(route: Route, serving: Serving, keys: Collection[str]):
    async def handle(request: Request) -> Response:
        try:
            if keys and not route.public:
                check_key(presented_key(request), keys)
            # whose processes and stored responses these are (a server without keys has one user)
            request.state.owner = owner_of(presented_key(request)) if keys else None
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
        path = request.url.path
        kind = "wrong_method" if getattr(exc, "status_code", 404) == 405 else "no_route"
        return api_of(path).error_response(ApiError(kind, f"no route {request.method} {path}"))

    routes = [StarletteRoute(r.path, _endpoint(r, serving, keys), methods=[r.method]) for r in ROUTES]
    return Starlette(routes=[*routes, *playground.PAGES, WebSocketRoute(WS_PATH, ws.endpoint(serving, keys))],
                     exception_handlers={404: not_found, 405: not_found})
