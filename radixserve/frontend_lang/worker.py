"""SerialWorker: runs submitted callables one at a time, in order, on one background thread.

A fork's children and a streamed program run on one each: `+=` on them returns at once and
reads wait, so sibling children generate concurrently (and the engine batches them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class SerialWorker:
    def __init__(self, name: str = "radixserve-program"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._last: Future | None = None
        self._thread_id: int | None = None
        self.error: BaseException | None = None

    def on_worker_thread(self) -> bool:
        return threading.get_ident() == self._thread_id

    def submit(self, fn: Callable[[], object]) -> None:
        """Queues `fn`; after a failure, queued work is skipped and `wait` raises the error."""
        self._last = self._pool.submit(self._run, fn)

    def wait(self) -> None:
        """Waits for everything queued so far; re-raises the first failure."""
        if self._last is not None:
            self._last.result()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _run(self, fn: Callable[[], object]) -> None:
        self._thread_id = threading.get_ident()
        if self.error is not None:
            return
        try:
            fn()
        except BaseException as exc:  # surfaced by wait(), in the thread that reads the state
            self.error = exc
