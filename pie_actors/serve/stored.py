"""`StoredResponses`: the responses POST /v1/responses keeps (store: true), by owner, bounded.

Each one keeps what GET returns, the conversation through its output (what a later request with
`previous_response_id` continues) and the working set its endpoint saved. Past the bound the oldest
go first; the caller deletes their saved working sets. Another owner's response does not exist.
Used from the server's event loop only.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["StoredResponse", "StoredResponses"]


@dataclass(frozen=True)
class StoredResponse:
    owner: str | None
    response: dict[str, Any]             # the response object, as GET returns it
    messages: list[dict[str, Any]]       # the conversation through its output, as the endpoint's messages
    saved: dict[str, Any] | None         # {"name", "tokens"}: the working set the endpoint saved


class StoredResponses:
    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self._kept: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()   # oldest first

    def put(self, response_id: str, stored: StoredResponse) -> list[StoredResponse]:
        """Keep `stored`; returns the ones dropped to stay within the bound."""
        self._kept[stored.owner, response_id] = stored
        dropped = []
        while len(self._kept) > self.limit:
            dropped.append(self._kept.popitem(last=False)[1])
        return dropped

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        return self._kept.get((owner, response_id))

    def pop(self, owner: str | None, response_id: str) -> StoredResponse | None:
        return self._kept.pop((owner, response_id), None)

    def __len__(self) -> int:
        return len(self._kept)
