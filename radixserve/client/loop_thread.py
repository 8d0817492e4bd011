"""LoopThread: an event loop on a daemon thread, so synchronous callers (Engine.generate, the
frontend's threads) can drive the async request stream from any thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
STOP_GRACE_S = 1.0
"""How long `LoopThread.stop` lets unfinished tasks run before it cancels them."""


class LoopThread:
    def __init__(self, name: str = "radixserve-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._waiting: set[concurrent.futures.Future] = set()  # what `run` callers wait on
        self._lock = threading.Lock()
        self._stopping = False

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the loop and waits for its result (cancelled if the wait is
        interrupted, e.g. by KeyboardInterrupt; RuntimeError if the loop stops first)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with self._lock:
            self._waiting.add(future)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise
        finally:
            with self._lock:
                self._waiting.discard(future)

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """Iterates an async generator from this thread; closing the iterator closes it."""
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self.loop.is_closed():  # (stopped under it: its error stands)
                try:
                    self.run(agen.aclose())
                except (RuntimeError, concurrent.futures.CancelledError):
                    if not self._stopping:  # the loop stopping under the close: the
                        raise  # stream's own error (engine shut down) is the answer

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Lets the tasks still on the loop finish (a stream whose engine shut down ends
        with that error), cancels those that do not within `grace_s`, then stops the loop:
        a caller waiting in `run` or `iterate` on another thread always gets an answer."""
        if self.loop.is_closed():
            return
        self._stopping = True
        future = asyncio.run_coroutine_threadsafe(_finish_tasks(grace_s), self.loop)
        future.result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        with self._lock:  # coroutines sent after the last tasks finished never ran: their
            stranded = [f for f in self._waiting if not f.done()]  # callers get an answer
        for future in stranded:
            if not future.cancel():
                future.set_exception(RuntimeError("the event loop stopped"))
        self.loop.close()


async def _finish_tasks(grace_s: float) -> None:
    """Waits up to `grace_s` for every other task on this loop, then cancels the rest."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=grace_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
