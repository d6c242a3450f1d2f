"""API keys: where a client presents one, whether it is valid, and whose processes it owns.

A client may present its key the way any of the APIs does: `Authorization: Bearer`, `x-api-key`,
`x-goog-api-key` or `?key=` (and, on the WebSocket, in its first frame).
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Collection

from starlette.requests import HTTPConnection

from .errors import ApiError

__all__ = ["presented_key", "check_key", "owner_of"]


def presented_key(connection: HTTPConnection) -> str | None:
    auth = connection.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return (connection.headers.get("x-api-key") or connection.headers.get("x-goog-api-key")
            or connection.query_params.get("key"))


def check_key(key: str | None, keys: Collection[str]) -> None:
    """An ApiError ("missing_key", "invalid_key") unless `key` is one of `keys`."""
    if not key:
        raise ApiError("missing_key", "this server needs an API key (Authorization: Bearer KEY, x-api-key, "
                                      "x-goog-api-key or ?key=)")
    if not any(hmac.compare_digest(key.encode(), k.encode()) for k in keys):
        raise ApiError("invalid_key", "the API key is not valid")


def owner_of(key: str | None) -> str | None:
    """The owner a key's processes are launched under: a digest, so the key itself never travels
    with them (None: the single user of a server without keys)."""
    return None if key is None else hashlib.sha256(key.encode()).hexdigest()[:32]
