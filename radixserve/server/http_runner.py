"""Runs an aiohttp app until SIGTERM or SIGINT, then stops it in order."""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

MALFORMED_LOG_INTERVAL_S = 10.0
"""At most one log line per this many seconds for malformed requests (MalformedRequestFilter)."""


class MalformedRequestFilter(logging.Filter):
    """aiohttp logs every malformed request (a bad request line, a URL or header past its
    limit, an HTTP/2 preface) at ERROR with its traceback, as often as a client sends one: a
    client could fill the log at will. Each still gets its 400; the log gets one WARNING line
    at most every `interval_s`, counting those since, and nothing for an HTTP/2 preface
    (sglang-router probes each worker it adds for gRPC that way before it settles on
    HTTP/1.1)."""

    def __init__(self, interval_s: float = MALFORMED_LOG_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.unreported = 0
        self._last_report = -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, BadHttpMessage):
            return True
        if "PRI/Upgrade" in str(exc):
            return False
        self.unreported += 1
        now = time.monotonic()
        if now - self._last_report < self.interval_s:
            return False
        detail = " ".join(str(exc).split())[:160]
        record.msg = "%d malformed HTTP request(s) answered 400 since the last report; last: %s"
        record.args = (self.unreported, f"{type(exc).__name__}: {detail}")
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        self.unreported, self._last_report = 0, now
        return True


MALFORMED_REQUEST_FILTER = MalformedRequestFilter()


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    name: str,
    drain: Callable[[], Awaitable],
    stop: asyncio.Event | None = None,
    limits: dict[str, Any] | None = None,
    on_start: Callable[[], None] | None = None,
    listen_while_draining: bool = False,
) -> None:
    """Serves `app`, printing "`name` ready at URL" once it listens (then calls `on_start`);
    on a signal (or when `stop` is set) stops taking connections, awaits `drain()` (in-flight
    requests finish or are aborted), then cleans up. `limits`: the connections' bounds
    (limits.runner_options). `listen_while_draining`: the listener closes after `drain()`
    instead of before (the app answers new requests itself meanwhile: server/drain.py)."""
    loop = asyncio.get_running_loop()
    logging.getLogger("aiohttp.server").addFilter(MALFORMED_REQUEST_FILTER)  # a set: added once
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, **(limits or {}))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(f"{name} ready at http://{host}:{port}", flush=True)
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_start is not None:
        on_start()
    await stop.wait()
    if not listen_while_draining:
        await site.stop()
    await drain()
    if listen_while_draining:
        await site.stop()
    await runner.cleanup()
