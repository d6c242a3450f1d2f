"""`/openapi.json`: the document of every route, its request shapes taken from the same pydantic
models that check the requests."""
from __future__ import annotations

import re
from typing import Any

from pydantic.json_schema import models_json_schema

from .errors import KINDS, ApiError
from .routes import Route

__all__ = ["document"]

# what each status a route may answer means; which statuses a route has comes from its API's shape
ERRORS = {"400": "A malformed body, a bad or unknown field, or a prompt over the model's context.",
          "401": "A missing or wrong API key (OpenAI, Anthropic).",
          "403": "No API key (Gemini).",
          "404": "An unknown model or path, or a stored response this key does not have.",
          "405": "A path the server has, asked with another method (OpenAI, Anthropic).",
          "429": "Over one of the key's quotas (serve.quotas): inferlets, tokens per minute, KV pages.",
          "500": "The endpoint inferlet failed.",
          "503": "The engine is still loading.",
          "529": "The engine is still loading (Anthropic's overloaded_error)."}
SECURITY = {"bearer": {"type": "http", "scheme": "bearer"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            "x-goog-api-key": {"type": "apiKey", "in": "header", "name": "x-goog-api-key"},
            "key": {"type": "apiKey", "in": "query", "name": "key"}}


def _responses(route: Route) -> dict[str, Any]:
    ok = {"application/json": {"schema": {"type": "object"}}}
    if route.streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    if route.path == "/metrics":
        ok = {"text/plain": {"schema": {"type": "string"}}}
    kinds = ("unavailable",) if route.public else KINDS
    statuses = sorted({str(route.api.shape(ApiError(kind, ""))[0]) for kind in kinds})
    return {"200": {"description": "OK", "content": ok},
            **{status: {"description": ERRORS[status],
                        "content": {"application/json": {"schema": {"type": "object"}}}} for status in statuses}}


def _parameters(route: Route) -> list[dict[str, Any]]:
    params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
              for name in re.findall(r"{(\w+)}", route.path)]
    return params + [{"name": name, "in": "query", "required": False, "schema": {"type": "string"}}
                     for name in route.query]


def document(routes: list[Route], title: str, version: str) -> dict[str, Any]:
    shapes = sorted({r.body for r in routes if r.body is not None}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in shapes], ref_template="#/components/schemas/{model}")
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        operation: dict[str, Any] = {"summary": route.summary, "responses": _responses(route),
                                     "operationId": re.sub(r"\W+", "_", f"{route.method}{route.path}").strip("_")}
        if route.public:
            operation["security"] = []
        if _parameters(route):
            operation["parameters"] = _parameters(route)
        if route.body is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[route.body, "validation"]}}}
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": defs.get("$defs", {}), "securitySchemes": SECURITY},
            "security": [{name: []} for name in SECURITY]}
