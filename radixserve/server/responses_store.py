"""Stored responses (`store: true`): what GET / DELETE /v1/responses/{id}, `input_items` and
`previous_response_id` read, kept in memory within `--responses-store-max-entries`,
`--responses-store-max-mb` and `--responses-store-ttl` (ttl_cache.py's `TtlStore`: the
oldest of the owner holding the most go first, so owners share the bounds fairly).

Tenants. A response belongs to the key its creator presented and to its namespace
(`cache_salt` or the X-Cache-Salt header, as tenants.py defines namespaces):

    owner = (the role whose key was presented | None without one, namespace | None)

and is stored under (owner, id): any other caller, the admin key included, finds nothing
there (404), so it can neither read, delete nor chain from it.

A record keeps the Response object, this turn's input items and the chain's history (every
earlier turn's input and output items, then this turn's): a chained request renders that
history before its own input, so its prompt starts with the previous turn's prompt and
output, which the radix tree holds. Its size is the JSON size of what it keeps.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from radixserve.config import ServerConfig
from radixserve.server.auth import caller_of
from radixserve.server.ttl_cache import TtlStore

logger = logging.getLogger(__name__)

Owner = tuple[str | None, str | None]


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]  # the chain's items up to and including this turn's output

    def num_bytes(self) -> int:
        return len(json.dumps([self.response, self.input_items, self.history]))


def owner_of(request: web.Request, namespace: str | None) -> Owner:
    """Whose a response is: the key the request proved (None: none) and its namespace."""
    caller = caller_of(request)
    return (caller.role.value if caller.by_key else None, namespace)


class ResponseStore:
    """Stored responses by owner and id (see the module doc)."""

    def __init__(self, ttl_s: float, max_entries: int, max_bytes: int):
        self._store = TtlStore(ttl_s, max_entries, max_bytes, group_of=lambda key: key[0])

    @classmethod
    def from_config(cls, config: ServerConfig) -> ResponseStore:
        max_bytes = int(config.responses_store_max_mb * (1 << 20))
        return cls(config.responses_store_ttl, config.responses_store_max_entries, max_bytes)

    def put(self, owner: Owner, record: StoredResponse) -> None:
        response_id = record.response["id"]
        if not self._store.put((owner, response_id), record, record.num_bytes()):
            logger.warning("response %s is over --responses-store-max-mb: not stored", response_id)

    def get(self, owner: Owner, response_id: str) -> StoredResponse | None:
        return self._store.get((owner, response_id))

    def delete(self, owner: Owner, response_id: str) -> bool:
        return self._store.pop((owner, response_id)) is not None

    def __len__(self) -> int:
        return len(self._store)

    @property
    def num_bytes(self) -> int:
        return self._store.num_bytes
