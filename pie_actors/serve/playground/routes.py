"""The playground's routes: its page and assets (public: a browser opens them before it has a
key), the examples it starts from, and the live view's figures (both behind the key, as every
route but /health). The page speaks the WebSocket at /v1/ws for runs, kills, messages and attaches.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as StarletteRoute

from ...gpu.engine.engine_process import EngineDown
from ..errors import ApiError
from ..openai_api import API
from ..routes import Route, Serving
from .examples import examples as find_examples

__all__ = ["ROUTES", "PAGES", "live_view"]

ASSETS = Path(__file__).resolve().parent
MEDIA = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
SERVED = frozenset(p.name for p in ASSETS.iterdir() if p.suffix in (".js", ".css"))
# everything the page loads or connects to is this server; no inline script runs, so text a
# program sends can never become code even if it reached the page as markup
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": POLICY, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer"}


async def page(request: Request) -> Response:
    return Response((ASSETS / "index.html").read_bytes(), media_type=MEDIA[".html"], headers=HEADERS)


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in SERVED:
        return API.error_response(ApiError("no_route", f"no playground asset {name!r}"))
    return Response((ASSETS / name).read_bytes(), media_type=MEDIA[Path(name).suffix], headers=HEADERS)


def live_view(serving: Serving, owner: str | None, stats: dict[str, Any] | None) -> dict[str, Any]:
    """What the live view shows, for `owner`: the engine's figures of `stats` (None: it does not
    serve now) and this key's processes only. Counters stay cumulative (batches by lanes, tokens
    computed); the page turns two readings into rates, with `time` (seconds, monotonic)."""
    view: dict[str, Any] = {"model": serving.model, "time": time.monotonic(),
                            "processes": serving.sessions.list(owner)}
    if stats is None:
        return view
    saved, parked = stats.get("saved", {}), stats.get("parked", {})
    return {**view, "batch_sizes": {str(k): v for k, v in stats.get("batch_sizes", {}).items()},
            "tokens_computed": stats.get("tokens_computed", 0),
            "kv": {**stats.get("kv", {}), "saved_sets": saved.get("kept", 0) + saved.get("spilled", 0)
                   + saved.get("tokens", 0), "spilled_sets": saved.get("spilled", 0) + parked.get("spilled", 0),
                   "parked_sets": parked.get("sets", 0)},
            "compile": stats.get("compile", {}), "engine_processes": stats.get("processes", 0)}


async def stats(serving: Serving, request: Request, body: None) -> Response:
    owner = request.state.owner
    if serving.loading_error is not None:
        return JSONResponse({"status": "failed", "error": serving.loading_error, **live_view(serving, owner, None)})
    if serving.endpoints is None:
        return JSONResponse({"status": "loading", **live_view(serving, owner, None)})
    runtime = serving.runtime
    try:
        figures = await asyncio.to_thread(runtime.stats)
        running = await asyncio.to_thread(runtime.running, owner)
    except EngineDown as e:              # its process died; another is starting (pie serve --local)
        return JSONResponse({"status": "restarting", "error": runtime.engine_down or str(e),
                             **live_view(serving, owner, None)})
    return JSONResponse({"status": "ok", "running": running, **live_view(serving, owner, figures)})


async def examples(serving: Serving, request: Request, body: None) -> Response:
    return JSONResponse({"examples": await asyncio.to_thread(find_examples)})


ROUTES = [
    Route("GET", "/playground/stats", API, stats, "The playground's live view: the engine's batches by lanes, "
          "tokens computed, KV pages (free, cached, referenced; saved, spilled and parked sets), compile progress, "
          "and this key's processes with their names and states.", engine=False),
    Route("GET", "/playground/examples", API, examples, "The example programs the playground starts from: "
          "their files and named inputs.", engine=False),
]
PAGES = [StarletteRoute("/", page, methods=["GET"]), StarletteRoute("/playground", page, methods=["GET"]),
         StarletteRoute("/playground/assets/{name}", asset, methods=["GET"])]
