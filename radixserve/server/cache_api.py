"""Cache introspection and retention endpoints: pin a prefix, unpin, list pins, summarize the
radix tree (for dashboards).

    POST /cache/pin       {"text" | "input_ids", "name", "ttl_s"?, "cache_salt"?}
                          prefills the prefix (max_new_tokens 0) and pins it as prefix:<name>
    POST /cache/unpin     {"name"} | {"session_id"}, "cache_salt"?  (a pin is its namespace's)
    GET  /cache/sessions  pins: sessions and prefixes, their sizes and TTLs
    GET  /cache/tree      ?top_k=10: node count, depth, largest subtrees with tokens and hits;
                          one walk of the tree per TREE_CACHE_S per set of namespaces shown

The GETs count every namespace but list the caller's only (admin: all; tenants.py).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from typing import Any

from aiohttp import web

from radixserve.cache.retention import check_pin_name, pin_room, prefix_pin_key, session_pin_key
from radixserve.client.request_builder import GenerateArgs
from radixserve.engine.protocol import PinRequest
from radixserve.server.errors import BadRequest, error_response
from radixserve.server.state import ServerState, read_json, state_of
from radixserve.server.tenants import namespaces_shown, public_pin, public_tree, shown_pins
from radixserve.server.ttl_cache import TtlCache

PIN_FIELDS = {"text", "input_ids", "name", "ttl_s", "cache_salt"}
MAX_TREE_TOP_K = 1000
TREE_CACHE_S = 1.0
"""How long one summary of the tree answers /cache/tree: the walk runs on the core thread."""
TREE_CACHE_KEY = web.AppKey("cache_tree_summaries", TtlCache)


async def pin_prefix(request: web.Request) -> web.Response:
    state = state_of(request)
    body = _object(await read_json(request), PIN_FIELDS)
    name = _name(body.get("name"), "name")
    ttl_s = _ttl(body.get("ttl_s"))
    args = GenerateArgs.from_fields(body, sampling_params={"max_new_tokens": 0})
    specs, batched = await state.off_loop(state.builder.build, args)
    if batched:
        raise BadRequest("pin one prefix per request: text or input_ids, not a list", "text")
    key = prefix_pin_key(name)
    await _check_room_for_pin(state, name, specs[0].namespace)
    specs = [replace(specs[0], pin=PinRequest(key, ttl_s))]
    await state.run(state.open(specs))
    pin = _find_pin(await state.client.list_pins(), "prefix", name, specs[0].namespace)
    if pin is None:
        await _check_room_for_pin(state, name, specs[0].namespace)
    pin = None if pin is None else public_pin(pin)
    return web.json_response({"name": name, "pinned": pin is not None, "pin": pin})


async def _check_room_for_pin(state: ServerState, name: str, namespace: str | None) -> None:
    """429 naming `name` when --max-pins pins are live and none may give way to it
    (retention.pin_room: no session pin, and this namespace holds its share) nor is `name`
    itself: the core would refuse the pin."""
    stats = await state.client.stats()
    pins = await state.client.list_pins()
    kinds = [(p["namespace"], p["kind"] == "session") for p in pins]
    if pin_room(kinds, namespace, stats["max_pins"])[0]:
        return
    if _find_pin(pins, "prefix", name, namespace) is None:
        message = (
            f"{len(pins)} prefixes are pinned, the most allowed (--max-pins), and this "
            "namespace holds its share of them; unpin one"
        )
        raise BadRequest(message, param="name", status=429)


async def unpin(request: web.Request) -> web.Response:
    body = _object(await read_json(request), {"name", "session_id", "cache_salt"})
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest(f"cache_salt must be a string; got {salt!r}", param="cache_salt")
    if ("name" in body) == ("session_id" in body):
        raise BadRequest("give exactly one of name (a pinned prefix) or session_id", "name")
    param = "name" if "name" in body else "session_id"
    name = _name(body[param], param)
    key = prefix_pin_key(name) if param == "name" else session_pin_key(name)
    if not await state_of(request).client.unpin(key, salt):
        kind = "prefix" if param == "name" else "session"
        return error_response(404, f"no {kind} pin {name!r} in this namespace", param=param)
    return web.json_response({"success": True})


async def list_sessions(request: web.Request) -> web.Response:
    client = state_of(request).client
    stats = await client.stats()
    pins = await client.list_pins()
    return web.json_response({
        "pins": shown_pins(pins, namespaces_shown(request)),
        "num_pins": len(pins),
        "pinned_pages": stats["tree_pinned_pages"],
        "max_pinned_pages": stats["max_pinned_pages"],
        "page_size": stats["page_size"],
        "pins_degraded": stats["pins_degraded"],
    })  # fmt: skip


async def tree(request: web.Request) -> web.Response:
    raw = request.query.get("top_k", "10")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_TREE_TOP_K:
        raise BadRequest(f"top_k must be an int in [1, {MAX_TREE_TOP_K}]; got {raw!r}", "top_k")
    client = state_of(request).client
    namespaces = namespaces_shown(request)
    fetch = partial(client.tree_summary, top_k=MAX_TREE_TOP_K, namespaces=namespaces)
    key = ("tree", None if namespaces is None else tuple(namespaces))
    summary = public_tree(await request.app[TREE_CACHE_KEY].get(key, fetch))
    top = summary["largest_subtrees"][: int(raw)]
    return web.json_response(summary | {"largest_subtrees": top})


def register_cache_routes(app: web.Application) -> None:
    app[TREE_CACHE_KEY] = TtlCache(TREE_CACHE_S)
    app.router.add_post("/cache/pin", pin_prefix)
    app.router.add_post("/cache/unpin", unpin)
    app.router.add_get("/cache/sessions", list_sessions)
    app.router.add_get("/cache/tree", tree)


def _object(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    for key in body:
        if key not in allowed:
            raise BadRequest(f"{key} is not a field of this endpoint", param=key)
    return body


def _name(value: Any, param: str) -> str:
    try:
        return check_pin_name(value, param)
    except ValueError as exc:
        raise BadRequest(str(exc), param=param) from None


def _ttl(value: Any) -> float | None:
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise BadRequest(f"ttl_s must be a number of seconds > 0; got {value!r}", "ttl_s")
    return float(value)


def _find_pin(pins: list[dict], kind: str, name: str, namespace: str | None) -> dict | None:
    matches = (p for p in pins if (p["kind"], p["name"], p["namespace"]) == (kind, name, namespace))
    return next(matches, None)
