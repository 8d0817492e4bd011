"""Browser attacks on a server that takes requests without a key (the default, loopback).

    DNS rebinding   a page on evil.example re-resolves its name to 127.0.0.1 and reads
                    this server as same-origin: its requests name `Host: evil.example`
                    -> 403 unless Host is loopback, --host or in --allowed-hosts
    cross-site      any page may POST a form to 127.0.0.1 (text/plain, urlencoded, multipart:
                    no preflight), the browser names its `Origin`
                    -> 403 unless Origin is loopback, --host or in --allowed-hosts;
                    -> 415 for a POST with a body that is not application/json
                    (bodiless POSTs, e.g. SGLang's /flush_cache, pass; the dashboard's login
                    form is urlencoded and /v1/files takes multipart uploads: the Origin
                    check covers them; an upload only stores a bounded file, which running
                    it as a batch, a JSON POST, would need)

Requests that carry a valid key (or the dashboard cookie, SameSite=Strict) skip this: a page
cannot know the key. /health and /metrics are open anyway (probes send their own Host).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from aiohttp import web

from radixserve.config import ServerConfig
from radixserve.server import dashboard
from radixserve.server.auth import OPEN_PATHS, caller_of
from radixserve.server.errors import error_response
from radixserve.server.state import state_of

LOOPBACK_NAMES = frozenset({"localhost"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
JSON_TYPE = "application/json"
FILE_UPLOAD_PATH = "/v1/files"


@web.middleware
async def browser_guard_middleware(request: web.Request, handler):
    """403 for a foreign Host or Origin, 415 for a non-JSON body, on requests without a key."""
    if request.path in OPEN_PATHS or caller_of(request).by_key:
        return await handler(request)
    allowed = allowed_hosts(state_of(request).config)
    host = request.headers.get("Host")
    if host is not None and not is_allowed(host_name(host), allowed):
        message = f"Host {host!r} is not this server's (--allowed-hosts names more)"
        return error_response(403, message, param="Host")
    origin = request.headers.get("Origin")
    if origin is not None and not is_allowed(origin_name(origin), allowed):
        message = f"Origin {origin!r} may not call this server (--allowed-hosts names more)"
        return error_response(403, message, param="Origin")
    if needs_json(request) and request.content_type != JSON_TYPE:
        message = f"a request body must be sent as Content-Type: {JSON_TYPE}"
        return error_response(415, f"{message}; got {request.content_type!r}", "Content-Type")
    return await handler(request)


def needs_json(request: web.Request) -> bool:
    """A POST that carries a body (the dashboard's login form and the Batch API's file upload,
    multipart as OpenAI's, aside: the Origin check covers them)."""
    if request.method != "POST" or not request.body_exists:
        return False
    return request.path not in (dashboard.LOGIN_PATH, FILE_UPLOAD_PATH)


def allowed_hosts(config: ServerConfig) -> frozenset[str]:
    """Names beside loopback that Host and Origin may carry: --host (when not a wildcard)
    and --allowed-hosts."""
    bound = config.host.strip("[]").lower()
    return config.allowed_host_names() | ({bound} - WILDCARD_HOSTS)


def is_allowed(name: str | None, allowed: frozenset[str]) -> bool:
    if name is None:
        return False
    if name in LOOPBACK_NAMES or name in allowed:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str | None:
    """`Host`'s name, lower-case, without port or IPv6 brackets; None if malformed."""
    return _name_of(f"//{host}")


def origin_name(origin: str) -> str | None:
    """`Origin`'s host name; None for `null` (sandboxed pages, file://) or a malformed one."""
    return _name_of(origin) if origin != "null" else None


def _name_of(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        return None
    return parts.hostname or None
