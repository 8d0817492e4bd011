"""Graceful drain: what SIGTERM does before `serve` exits 0.

    SIGTERM -> 1 leave the router (--router-url): it stops sending here; requests it already
               sent are still taken
            -> 2 draining: every new request gets 503 in its API's error shape (OpenAI's,
               Anthropic's on /v1/messages), /health 503 so load balancers stop too;
               /metrics and /abort_request still answer
            -> 3 running requests finish, at most --drain-timeout s; then the rest are aborted
            -> 4 the listener closes, the server exits 0

The listener stays open through 2-3, so a client that still comes gets a 503 it can retry
elsewhere rather than a refused connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from radixserve.client.client import EngineClient
from radixserve.server.errors import error_response

logger = logging.getLogger(__name__)

POLL_S = 0.05
ABORTED_WAIT_S = 5.0
"""After the abort, how long handlers get to send their last bytes."""
OPEN_WHILE_DRAINING = frozenset({"/metrics", "/abort_request"})
"""Routes that still answer while draining: scraping, and cancelling what runs."""


class Drain:
    """Counts the requests in flight and refuses new ones once draining."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if self.draining and request.path not in OPEN_WHILE_DRAINING:
            message = "server is shutting down; retry on another worker"
            response = error_response(503, message, headers={"Retry-After": "1"})
            response.force_close()
            return response
        self.num_in_flight += 1
        try:
            return await handler(request)
        finally:
            self.num_in_flight -= 1

    async def run(
        self,
        client: EngineClient,
        timeout_s: float,
        leave_router: Callable[[], Awaitable] | None = None,
    ) -> None:
        """Steps 1-3 above: leave the router, refuse new requests, let running ones finish
        for `timeout_s`, then abort what is left and wait for it to end."""
        if leave_router is not None:
            await leave_router()
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._busy(client) and not client.dead and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        if client.num_active:
            logger.warning("drain: aborting %d requests after %.0f s", client.num_active, timeout_s)
        client.abort(client.active_request_ids())
        deadline = loop.time() + ABORTED_WAIT_S
        while self._busy(client) and not client.dead and loop.time() < deadline:
            await asyncio.sleep(POLL_S)

    def _busy(self, client: EngineClient) -> bool:
        return client.num_active > 0 or self.num_in_flight > 0


DRAIN_KEY = web.AppKey("drain", Drain)
