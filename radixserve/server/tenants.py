"""What a tenant may see of the cache. A namespace is what a request's `cache_salt` names (the
salt is the tenant's secret, as in vLLM and SGLang); requests without one share the default
namespace.

    caller                 X-Cache-Salt: s   sees the prompts (token ids) and pins of
    admin (or no key set)  absent            every namespace
    user                   absent            the default namespace
    either                 present           namespace s only

Everyone sees the aggregate counts. A salt never leaves the server: a namespace is shown as
`namespace_label`, an HMAC under a key drawn at start, the same for one salt while the
process lives and unlinkable to the salt without that key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from aiohttp import web

from radixserve.server.auth import is_admin
from radixserve.server.errors import BadRequest

SALT_HEADER = "X-Cache-Salt"
"""How a GET names the caller's namespace (a salt stays out of URLs and their logs)."""
_LABEL_KEY = secrets.token_bytes(32)
LABEL_HEX_CHARS = 16


def check_salt(value: Any, header: str | None) -> str | None:
    """A generation request's namespace: its body's `cache_salt` or its X-Cache-Salt header
    (both given: the same), as every chat API reads it."""
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"cache_salt must be a string; got {value!r}"[:160], param="cache_salt")
    if value is not None and header is not None and value != header:
        raise BadRequest("cache_salt and the X-Cache-Salt header differ", param="cache_salt")
    return value if value is not None else header


def namespaces_shown(request: web.Request) -> list[str | None] | None:
    """The namespaces whose details this request may read; None: all of them."""
    salt = request.headers.get(SALT_HEADER)
    if salt is not None:
        return [salt]
    return None if is_admin(request) else [None]


def namespace_label(namespace: str | None) -> str | None:
    """The name a namespace is shown by (None: the default namespace)."""
    if namespace is None:
        return None
    digest = hmac.new(_LABEL_KEY, namespace.encode("utf-8", "surrogateescape"), hashlib.sha256)
    return "ns-" + digest.hexdigest()[:LABEL_HEX_CHARS]


def shown_pins(pins: list[dict], namespaces: list[str | None] | None) -> list[dict]:
    """The pins of `namespaces` (None: all), each naming its namespace by label."""
    return [public_pin(pin) for pin in pins if namespaces is None or pin["namespace"] in namespaces]


def public_pin(pin: dict[str, Any]) -> dict[str, Any]:
    return pin | {"namespace": namespace_label(pin["namespace"])}


def public_tree(summary: dict[str, Any]) -> dict[str, Any]:
    """A tree summary whose subtrees name their namespace by label."""
    subtrees = [
        s | {"namespace": namespace_label(s["namespace"])} for s in summary["largest_subtrees"]
    ]
    return summary | {"largest_subtrees": subtrees}
