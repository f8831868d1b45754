"""The stored responses behind `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`.

In memory, on the event loop (no lock), least recently used first out, bounded by a
count and by bytes (`--responses-store-max-entries`, `--responses-store-max-bytes`).
Each entry holds the Response object as it was answered and the whole conversation
through it, as chat messages (without `instructions`, which OpenAI does not carry
over), so a follow-up turn needs that one entry only: evicting an older turn of the
same chain never breaks a newer one. A response larger than the byte bound on its own
is not stored; a later reference to it is a 404, as for an evicted or unknown id.
Nothing survives a restart, as with vLLM's store. An entry belongs to the tenant that
made it (`app.server.auth.tenant_of`: the key it presented): to any other it does not
exist, a 404 as for an unknown id, whether read, continued or deleted.
"""

from __future__ import annotations

import hmac
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as answered
    conversation: list[dict[str, Any]]  # chat messages through this response's output
    size: int  # bytes of both, as JSON
    owner: str  # the tenant that stored it ("" for requests without a key)


class ResponseStore:
    """An LRU map of response id → StoredResponse. Invariant: `len(self) <=
    max_entries` and `self.bytes <= max_bytes`, `self.bytes` the sum of the sizes."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            owner: str = "") -> bool:
        """Store `owner`'s response (evicting the least recently used); False if it alone
        is larger than the byte bound, or the store holds nothing (a bound of 0)."""
        size = _json_size(response) + _json_size(conversation)
        if size > self.max_bytes or self.max_entries == 0:
            return False
        self._drop(response["id"])
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.bytes + size > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        self._entries[response["id"]] = StoredResponse(response, conversation, size, owner)
        self.bytes += size
        return True

    def get(self, response_id: str, owner: str = "") -> StoredResponse | None:
        """`owner`'s response of that id, or None (none, or another tenant's)."""
        entry = self._entries.get(response_id)
        if entry is None or not hmac.compare_digest(entry.owner, owner):
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str = "") -> bool:
        """Drop `owner`'s response of that id; False where there is none of theirs."""
        return self.get(response_id, owner) is not None and self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def check(self) -> None:
        assert len(self._entries) <= self.max_entries
        assert self.bytes == sum(e.size for e in self._entries.values()) <= self.max_bytes


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
