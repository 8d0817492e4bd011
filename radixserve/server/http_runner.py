"""Runs an aiohttp app until SIGTERM or SIGINT, then stops it in order."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage


class Http2ProbeFilter(logging.Filter):
    """Drops aiohttp's traceback for an HTTP/2 connection preface. sglang-router probes each
    worker it adds for gRPC that way before it settles on HTTP/1.1; the probe still gets its
    400, the log just stays readable."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI/Upgrade" in str(exc))


HTTP2_PROBE_FILTER = Http2ProbeFilter()


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
    logging.getLogger("aiohttp.server").addFilter(HTTP2_PROBE_FILTER)  # once: filters are a set
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
