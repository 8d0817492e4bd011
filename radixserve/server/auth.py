"""Who is calling: the API keys, the role each grants, and the routes each role may reach.

    keys set            caller presents            role     by_key
    none                anything                   admin    no    (loopback; request_guard.py)
    --api-key only      it                         admin    yes   (one key: the operator's)
    --admin-api-key     it (or the dashboard       admin    yes
                        cookie it opened)
    both                --api-key                  user     yes
    admin key only      no key                     user     no
    --api-key set       nothing that matches       401
    any                 a key, from a non-loopback 429 (before any comparison)
                        address with API_KEY_MAX_
                        FAILURES wrong ones lately
Loopback callers are not throttled: behind the fleet's router (or a local proxy) every client
shares one loopback address, and one client's wrong keys would lock all of them out.

Admin routes (ADMIN_PATHS, the dashboard) answer a user 403 (401 when it sent no key).
/cache/tree and /cache/sessions answer a user about its own namespace only (tenants.py).
/health (and vLLM's /ping), /metrics and `/` (a fixed text: the Ollama CLI's heartbeat) are open
to everyone: probes and scrapers carry no key.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass

from aiohttp import web

from radixserve.config import ServerConfig
from radixserve.config.disaggregation import is_loopback_host
from radixserve.server import dashboard
from radixserve.server.errors import error_response
from radixserve.server.limits import API_KEY_MAX_FAILURES, LoginThrottle
from radixserve.server.state import state_of

OPEN_PATHS = ("/health", "/ping", "/metrics", "/")
"""The only paths served without a key: probes and scrapers carry none (`/` is the Ollama
CLI's heartbeat, a fixed text). Not /health_generate: it runs a generation on the GPU."""
ADMIN_PATHS = (
    "/flush_cache", "/reset_prefix_cache", "/check_integrity", "/load_lora_adapter",
    "/unload_lora_adapter",
)  # fmt: skip
"""Admin-only besides the dashboard: they act on (or read) every tenant's cache."""


class Role(enum.Enum):
    USER = "user"
    ADMIN = "admin"


@dataclass(frozen=True)
class Caller:
    """The role a request acts in, and whether a key (or the dashboard cookie) proved it."""

    role: Role
    by_key: bool


CALLER_KEY = web.RequestKey("caller", Caller)
KEY_THROTTLE_KEY = web.AppKey("api_key_throttle", LoginThrottle)


def caller_of(request: web.Request) -> Caller:
    """The caller the auth middleware identified (an open path's caller is a user)."""
    return request.get(CALLER_KEY, Caller(Role.USER, by_key=False))


def is_admin(request: web.Request) -> bool:
    return caller_of(request).role is Role.ADMIN


@web.middleware
async def auth_middleware(request: web.Request, handler):
    if request.path in OPEN_PATHS:
        return await handler(request)
    address = request.remote or ""
    throttle = None if is_loopback_host(address) else request.app.get(KEY_THROTTLE_KEY)
    presented = _presents_a_key(request)
    if presented and throttle is not None and (wait_s := throttle.retry_after(address)):
        message = f"too many wrong API keys from this address; retry in {wait_s} s"
        response = error_response(429, message, param="Authorization")
        response.headers["Retry-After"] = str(wait_s)
        return response
    caller = await identify(request, state_of(request).config)
    if caller is not None and (caller.role is Role.ADMIN or not needs_admin(request.path)):
        request[CALLER_KEY] = caller
        return await handler(request)
    if caller is not None and caller.by_key:
        message = "this route needs the admin API key (--admin-api-key)"
        return error_response(403, message, param="Authorization")
    if (login_form := dashboard.unauthorized(request)) is not None:
        return login_form
    if presented and throttle is not None:
        throttle.record_failure(address)
    return error_response(401, "missing or invalid API key", param="Authorization")


def install_key_throttle(app: web.Application) -> None:
    """Counts wrong API keys per client address (the auth middleware reads it)."""
    app[KEY_THROTTLE_KEY] = LoginThrottle(max_failures=API_KEY_MAX_FAILURES)


def _presents_a_key(request: web.Request) -> bool:
    return "Authorization" in request.headers or "x-api-key" in request.headers


def needs_admin(path: str) -> bool:
    return path in ADMIN_PATHS or dashboard.is_dashboard_path(path)


async def identify(request: web.Request, config: ServerConfig) -> Caller | None:
    """The request's caller per the table above; None: a key is required and none matched."""
    admin_key = admin_level_key(config)
    if admin_key is not None and await _opens_admin(request, admin_key):
        return Caller(Role.ADMIN, by_key=True)
    if config.admin_api_key and config.api_key and presents_key(request, config.api_key):
        return Caller(Role.USER, by_key=True)
    if config.api_key is not None:
        return None
    return Caller(Role.USER if config.admin_api_key else Role.ADMIN, by_key=False)


def admin_level_key(config: ServerConfig) -> str | None:
    """The key that makes its holder admin: --admin-api-key, else the one --api-key."""
    return config.admin_api_key or config.api_key


async def _opens_admin(request: web.Request, key: str) -> bool:
    """The admin key in a header, or on the dashboard's paths its session cookie or login
    form."""
    if presents_key(request, key):
        return True
    return dashboard.has_session(request) or await dashboard.posts_key(request, key)


def presents_key(request: web.Request, key: str) -> bool:
    """Whether `Authorization: Bearer <key>` or Anthropic's `x-api-key: <key>` is sent."""
    if api_key_matches(request.headers.get("Authorization", ""), key):
        return True
    given = request.headers.get("x-api-key")
    return given is not None and api_key_matches(f"Bearer {given}", key)


def api_key_matches(authorization: str, key: str) -> bool:
    """Whether the Authorization header is `Bearer <key>`, compared in constant time so the
    answer's timing tells nothing about how much of a guess was right."""
    given = authorization.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {key}".encode())
