"""Bounds on what one HTTP client may make the server hold: time to send a request, body size,
dashboard login attempts.

    connection open ──headers──> request ──body──> handler ──response──> idle ──headers──> ...
                    └ --timeout-keep-alive ┘  └ --http-read-timeout ┘          └ same ┘
    header lines and fields: at most MAX_LINE_BYTES each, MAX_HEADERS of them (400 beyond)
    body: Content-Length over --max-body-mb -> 413 before a byte is read; a chunked body is
          counted as it arrives (413); the whole body must arrive within the read timeout
          (408, then the connection closes after LINGERING_TIME_S)
    dashboard login: a form of at most LOGIN_MAX_BODY_BYTES with a Content-Length; an address
          with LOGIN_MAX_FAILURES wrong keys in LOGIN_WINDOW_S gets 429 until the oldest ages out
    API keys: an address with API_KEY_MAX_FAILURES wrong keys in LOGIN_WINDOW_S gets 429 for
          any request carrying a key, before it is compared (auth.py)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from radixserve.config import ServerConfig
from radixserve.server.errors import BadRequest, error_response
from radixserve.server.state import state_of

MAX_LINE_BYTES = 8190  # aiohttp's defaults, stated: a request line or one header field
MAX_HEADERS = 128
LINGERING_TIME_S = 2.0
"""After answering a request whose body was not read in full (413, 408, 401), how long the
server still drains it so that the client sees the answer; then the connection closes."""
LOGIN_MAX_BODY_BYTES = 4096  # a form with one key field
LOGIN_MAX_FAILURES = 5
LOGIN_WINDOW_S = 60.0
LOGIN_MAX_ADDRESSES = 4096  # addresses whose recent failures are remembered, oldest dropped
API_KEY_MAX_FAILURES = 30
"""Wrong API keys (Authorization / x-api-key) an address may send per LOGIN_WINDOW_S before
its requests with a key get 429: far too few to guess a key, enough that one misconfigured
client behind a shared address (a router) does not lock the others out at once."""


def runner_options(config: ServerConfig) -> dict[str, Any]:
    """aiohttp's connection-level bounds for `web.AppRunner` (see the module sketch)."""
    return {
        "keepalive_timeout": config.timeout_keep_alive,
        "lingering_time": LINGERING_TIME_S,
        "max_line_size": MAX_LINE_BYTES,
        "max_field_size": MAX_LINE_BYTES,
        "max_headers": MAX_HEADERS,
    }


def max_body_bytes(config: ServerConfig) -> int:
    return int(config.max_body_mb * (1 << 20))


@web.middleware
async def body_size_middleware(request: web.Request, handler):
    """A body whose Content-Length is over the limit is a 413 before any of it is read;
    otherwise the body is read in full (a chunked one bounded by client_max_size as it
    arrives) within the read timeout, before the handler runs."""
    config = state_of(request).config
    limit = max_body_bytes(config)
    length = request.content_length
    if length is not None and length > limit:
        message = f"request body is {length} bytes; the limit is {limit} bytes (--max-body-mb)"
        response = error_response(413, message, param="body")
        response.force_close()  # the body stays unread: do not keep the connection
        return response
    try:
        await read_body(request, config.http_read_timeout)
    except BadRequest as exc:  # 408: the rest of the body may never come
        response = error_response(exc.status, str(exc), param=exc.param)
        response.force_close()
        return response
    return await handler(request)


async def read_body(request: web.Request, timeout_s: float, max_bytes: int | None = None) -> bytes:
    """The request's body, read once (later `read()` / `post()` calls return it); 408 when it
    does not arrive within `timeout_s`. With `max_bytes`: a Content-Length is required (411)
    and may not exceed it (413)."""
    if max_bytes is not None:
        length = request.content_length
        if length is None:
            raise BadRequest("this request needs a Content-Length", param="body", status=411)
        if length > max_bytes:
            message = f"request body is {length} bytes; the limit here is {max_bytes} bytes"
            raise BadRequest(message, param="body", status=413)
    if not request.body_exists:
        return b""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        message = f"request body did not arrive within {timeout_s:g} s (--http-read-timeout)"
        raise BadRequest(message, param="body", status=408) from None


class LoginThrottle:
    """Failed dashboard logins per client address over the last `window_s` seconds; an
    address at `max_failures` is refused until its oldest failure ages out. Remembers at most
    `max_addresses` addresses (the least recently failing go first)."""

    def __init__(
        self,
        max_failures: int = LOGIN_MAX_FAILURES,
        window_s: float = LOGIN_WINDOW_S,
        max_addresses: int = LOGIN_MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_addresses = max_addresses
        self.clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, address: str) -> int | None:
        """Whole seconds until `address` may try again; None: it may now."""
        times = self._recent(address)
        if len(times) < self.max_failures:
            return None
        return max(math.ceil(times[0] + self.window_s - self.clock()), 1)

    def record_failure(self, address: str) -> None:
        times = self._recent(address)
        if not times:
            times = self._failures[address] = deque(maxlen=self.max_failures)
        times.append(self.clock())
        self._failures.move_to_end(address)
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)

    def __len__(self) -> int:
        return len(self._failures)

    def _recent(self, address: str) -> deque[float]:
        times = self._failures.get(address)
        if times is None:
            return deque()
        oldest = self.clock() - self.window_s
        while times and times[0] <= oldest:
            times.popleft()
        if not times:
            del self._failures[address]
        return times
