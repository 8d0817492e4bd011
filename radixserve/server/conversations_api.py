"""OpenAI's Conversations API: a conversation is a list of Responses items kept by the server,
as the OpenAI Agents SDK's OpenAIConversationsSession keeps an agent's history.

    POST   /v1/conversations                      {"items"?: [...] (<= 20), "metadata"?}
    GET    /v1/conversations/{id}                 POST it {"metadata"} to update it
    DELETE /v1/conversations/{id}                 -> {"id", "object": "conversation.deleted"}
    POST   /v1/conversations/{id}/items           {"items": [...] (1-20)} -> the added items
    GET    /v1/conversations/{id}/items           ?after&limit&order (default desc), paged
    GET    /v1/conversations/{id}/items/{item}    DELETE it -> the conversation

Items are checked and normalized as Responses input items (responses_items.py: each gets an
id). A conversation belongs to its creator's key and namespace, as stored responses do
(responses_store.owner_of; the namespace from the X-Cache-Salt header, as every GET takes
it): any other caller gets 404. Conversations are kept in memory in a
TtlStore of their own within the Responses store's bounds (`--responses-store-max-entries`,
`--responses-store-max-mb`, `--responses-store-ttl`), each with at most MAX_ITEMS items.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from radixserve.server.errors import BadRequest
from radixserve.server.request_fields import check_fields
from radixserve.server.responses_items import check_input, item_page, list_body
from radixserve.server.responses_options import check_metadata
from radixserve.server.responses_store import Owner, owner_of
from radixserve.server.state import STATE_KEY, read_json
from radixserve.server.tenants import SALT_HEADER
from radixserve.server.ttl_cache import TtlStore

MAX_ITEMS_PER_CALL = 20
"""OpenAI's bound on the items one create call adds."""
MAX_ITEMS = 10_000
"""Items one conversation holds at most (older ones stay: the add is refused)."""


@dataclass(frozen=True)
class Conversation:
    """One conversation; a change makes a new value (the stored one stays as it was if the
    new one cannot be stored). `items_bytes`: its items' JSON sizes, kept as items come and
    go, so that an add measures the new items only."""

    id: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    items_bytes: int = 0

    def card(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}  # fmt: skip

    def num_bytes(self) -> int:
        """len(json.dumps([metadata, items])), without serializing the items again."""
        separators = 2 * max(len(self.items) - 1, 0)
        return len(json.dumps([self.metadata, []])) + self.items_bytes + separators

    def with_items(self, items: list[dict[str, Any]]) -> Conversation:
        added = sum(len(json.dumps(item)) for item in items)
        return replace(self, items=self.items + items, items_bytes=self.items_bytes + added)

    def without(self, item: dict[str, Any]) -> Conversation:
        kept = [i for i in self.items if i is not item]
        return replace(self, items=kept, items_bytes=self.items_bytes - len(json.dumps(item)))


STORE_KEY = web.AppKey("conversations", TtlStore)


def register_conversation_routes(app: web.Application) -> None:
    config = app[STATE_KEY].config
    max_bytes = int(config.responses_store_max_mb * (1 << 20))
    app[STORE_KEY] = TtlStore(config.responses_store_ttl, config.responses_store_max_entries,
                              max_bytes, group_of=lambda key: key[0])  # fmt: skip
    app.router.add_post("/v1/conversations", create)
    app.router.add_get("/v1/conversations/{conversation_id}", retrieve)
    app.router.add_post("/v1/conversations/{conversation_id}", update)
    app.router.add_delete("/v1/conversations/{conversation_id}", delete)
    app.router.add_post("/v1/conversations/{conversation_id}/items", add_items)
    app.router.add_get("/v1/conversations/{conversation_id}/items", list_items)
    app.router.add_get("/v1/conversations/{conversation_id}/items/{item_id}", retrieve_item)
    app.router.add_delete("/v1/conversations/{conversation_id}/items/{item_id}", delete_item)


# ---- handlers ----------------------------------------------------------------------------


async def create(request: web.Request) -> web.Response:
    body = await _body(request, {"items", "metadata"})
    items = _items(body.get("items"), allow_empty=True)
    conversation = Conversation("conv_" + uuid.uuid4().hex, int(time.time()),
                                check_metadata(body.get("metadata"))).with_items(items)  # fmt: skip
    _put(request, conversation)
    return web.json_response(conversation.card())


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(_conversation(request).card())


async def update(request: web.Request) -> web.Response:
    body = await _body(request, {"metadata"})
    if body.get("metadata") is None:
        raise BadRequest("metadata is required", param="metadata")
    conversation = replace(_conversation(request), metadata=check_metadata(body["metadata"]))
    _put(request, conversation)
    return web.json_response(conversation.card())


async def delete(request: web.Request) -> web.Response:
    conversation = _conversation(request)
    _store(request).pop(_key(request, conversation.id))
    return web.json_response(
        {"id": conversation.id, "object": "conversation.deleted", "deleted": True}
    )


async def add_items(request: web.Request) -> web.Response:
    body = await _body(request, {"items"})
    items = _items(body.get("items"), allow_empty=False)
    conversation = _conversation(request)
    if len(conversation.items) + len(items) > MAX_ITEMS:
        raise BadRequest(f"a conversation holds at most {MAX_ITEMS} items", param="items")
    _put(request, conversation.with_items(items))
    return web.json_response(list_body(items, has_more=False))


async def list_items(request: web.Request) -> web.Response:
    page = item_page(_conversation(request).items, request.query, "this conversation")
    return web.json_response(page)


async def retrieve_item(request: web.Request) -> web.Response:
    return web.json_response(_item(_conversation(request), request.match_info["item_id"]))


async def delete_item(request: web.Request) -> web.Response:
    conversation = _conversation(request)
    item = _item(conversation, request.match_info["item_id"])
    _put(request, conversation.without(item))
    return web.json_response(conversation.card())


# ---- a Response's conversation ------------------------------------------------------------


def conversation_items(app: web.Application, owner: Owner, conversation_id: str) -> list:
    """The items a Response with `conversation` continues; 404 naming the field if absent."""
    conversation = app[STORE_KEY].get((owner, conversation_id))
    if conversation is None:
        raise BadRequest(f"no conversation {conversation_id!r}", param="conversation", status=404)
    return conversation.items


def append_items(
    app: web.Application, owner: Owner, conversation_id: str, items: list[dict[str, Any]]
) -> bool:
    """Adds a finished Response's input and output items to its conversation; False when it
    is gone (deleted meanwhile) or would pass the bounds: the Response stands either way."""
    store = app[STORE_KEY]
    conversation = store.get((owner, conversation_id))
    if conversation is None or len(conversation.items) + len(items) > MAX_ITEMS:
        return False
    return _keep(store, (owner, conversation_id), conversation.with_items(items))


# ---- helpers -----------------------------------------------------------------------------


async def _body(request: web.Request, known: set[str]) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    check_fields(body, known)
    return body


def _items(value: Any, allow_empty: bool) -> list[dict[str, Any]]:
    if value is None or value == []:
        if allow_empty:
            return []
        raise BadRequest("items must be a non-empty list of items", param="items")
    if not isinstance(value, list):
        raise BadRequest(f"items must be a list of items; got {value!r}"[:160], param="items")
    if len(value) > MAX_ITEMS_PER_CALL:
        raise BadRequest(f"items holds at most {MAX_ITEMS_PER_CALL} items; got {len(value)}",
                         param="items")  # fmt: skip
    try:
        return check_input(value)
    except BadRequest as exc:  # its paths read input[i]: here they are items[i]
        message, param = str(exc).replace("input", "items", 1), exc.param or "items"
        raise BadRequest(message, param=param.replace("input", "items", 1)) from None


def _store(request: web.Request) -> TtlStore:
    return request.app[STORE_KEY]


def _owner(request: web.Request) -> Owner:
    return owner_of(request, request.headers.get(SALT_HEADER))


def _key(request: web.Request, conversation_id: str) -> tuple[Owner, str]:
    return (_owner(request), conversation_id)


def _put(request: web.Request, conversation: Conversation) -> None:
    """Stores `conversation` for the request's caller; 413 when it is past the byte bound."""
    if not _keep(_store(request), _key(request, conversation.id), conversation):
        raise BadRequest("the conversation would be larger than --responses-store-max-mb",
                         param="items", status=413)  # fmt: skip


def _keep(store: TtlStore, key: tuple[Owner, str], conversation: Conversation) -> bool:
    """Stores `conversation` under `key`; False (the stored value untouched) when it alone
    is past the store's byte bound."""
    num_bytes = conversation.num_bytes()
    return num_bytes <= store.max_bytes and store.put(key, conversation, num_bytes)


def _conversation(request: web.Request) -> Conversation:
    conversation_id = request.match_info["conversation_id"]
    conversation = _store(request).get(_key(request, conversation_id))
    if conversation is None:
        raise BadRequest(f"no conversation {conversation_id!r}", param="conversation_id",
                         status=404)  # fmt: skip
    return conversation


def _item(conversation: Conversation, item_id: str) -> dict[str, Any]:
    for item in conversation.items:
        if item["id"] == item_id:
            return item
    raise BadRequest(f"no item {item_id!r} in conversation {conversation.id!r}",
                     param="item_id", status=404)  # fmt: skip
