"""A pytest plugin that bench/compat.py loads into llama.cpp's server tests, for the two ways
llama-server is laxer than the APIs it copies (pie serve follows the APIs):

- it answers its OpenAI routes with and without the /v1 prefix, and the suite calls the bare forms
  (`/chat/completions`, `/responses`); pie serve, like OpenAI's API, answers them under /v1 only;
- it takes a request with no `model` (or null); OpenAI's API requires one, as pie serve does: the
  suite's requests without one name "default".

The suite's llama.cpp-only routes (`/apply-template`, `/chat/completions/input_tokens`, ...) are left as
they are, so their tests fail.
"""
from __future__ import annotations

from typing import Any

OPENAI_ROUTES = ("/chat/completions", "/completions", "/responses", "/embeddings", "/models")


def with_model(data: Any) -> Any:
    return {**data, "model": "default"} if isinstance(data, dict) and data.get("model") is None else data


def pytest_configure(config) -> None:
    import utils  # the suite's harness, importable once pytest runs in its folder

    server = utils.ServerProcess
    make_url, make_request, make_stream_request = server.make_url, server.make_request, server.make_stream_request

    def make_v1_url(self, path: str, host: str | None = None) -> str:
        return make_url(self, "/v1" + path if path in OPENAI_ROUTES else path, host)

    def make_request_with_model(self, method: str, path: str, data: Any = None, *args: Any, **kw: Any) -> Any:
        return make_request(self, method, path, with_model(data), *args, **kw)

    def make_stream_request_with_model(self, method: str, path: str, data: Any = None, *args: Any, **kw: Any) -> Any:
        return make_stream_request(self, method, path, with_model(data), *args, **kw)

    server.make_url = make_v1_url
    server.make_request = make_request_with_model
    server.make_stream_request = make_stream_request_with_model
