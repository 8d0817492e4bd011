"""Runs an aiohttp app until SIGTERM or SIGINT, then stops it in order."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    name: str,
    drain: Callable[[], Awaitable],
    stop: asyncio.Event | None = None,
) -> None:
    """Serves `app`, printing "`name` ready at URL" once it listens; on a signal (or when
    `stop` is set) stops taking connections, awaits `drain()` (in-flight requests finish or
    are aborted), then cleans up."""
    loop = asyncio.get_running_loop()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(f"{name} ready at http://{host}:{port}", flush=True)
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await site.stop()
    await drain()
    await runner.cleanup()
