"""LoopThread: an event loop on a daemon thread, so synchronous callers (Engine.generate, the
frontend's threads) can drive the async request stream from any thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "radixserve-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the loop and waits for its result (cancelled if the wait is
        interrupted, e.g. by KeyboardInterrupt)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """Iterates an async generator from this thread; closing the iterator closes it."""
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.run(agen.aclose())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
