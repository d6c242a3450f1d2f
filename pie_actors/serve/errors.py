"""`ApiError`: a request the server answers with an error. Each API module writes it in its own shape
(status code, body); `kind` is the neutral name of what went wrong."""
from __future__ import annotations

__all__ = ["ApiError", "KINDS"]

KINDS = ("invalid_request",          # malformed JSON, a bad field, a value the endpoint refuses
         "context_length_exceeded",  # the prompt does not fit the model's context
         "missing_key", "invalid_key",
         "not_found",                # an unknown model
         "no_route", "wrong_method",  # a path the server does not have; one it has, with another method
         "rate_limited",             # over one of the key's quotas (quotas.py)
         "unavailable",              # the engine is still loading
         "server_error")             # the endpoint inferlet failed


class ApiError(Exception):
    def __init__(self, kind: str, message: str, param: str | None = None) -> None:
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param
