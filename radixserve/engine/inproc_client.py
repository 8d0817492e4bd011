"""InProcessClient: the engine core on a thread of this process (what `Engine` uses).

One core thread runs the CoreLoop for every caller, so requests from many threads and event
loops batch together; deltas reach each stream on its own loop.
"""

from __future__ import annotations

import logging
import queue
import threading

from radixserve.engine.client import EngineClient
from radixserve.engine.core import EngineCore
from radixserve.engine.core_loop import CoreLoop
from radixserve.engine.protocol import CallResult, FromCore, StepOutputs, ToCore

logger = logging.getLogger(__name__)


class _QueueTransport:
    """Messages in through a thread-safe queue (None closes); out through a callback."""

    def __init__(self, inbox: queue.SimpleQueue, client: InProcessClient):
        self.inbox = inbox
        self.client = client

    def receive(self, timeout: float | None) -> list[ToCore] | None:
        try:
            first = self.inbox.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return []
        messages = [first]
        while not self.inbox.empty():
            messages.append(self.inbox.get_nowait())
        return None if any(m is None for m in messages) else messages

    def send(self, message: FromCore) -> None:
        self.client._on_message(message)


class InProcessClient(EngineClient):
    def __init__(self, core: EngineCore):
        super().__init__()
        self.core = core
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="radixserve-core", daemon=True)
        self._thread.start()

    def _send(self, message) -> None:
        self._inbox.put(message)

    def _run(self) -> None:
        try:
            CoreLoop(self.core, _QueueTransport(self._inbox, self)).run()
        except BaseException as exc:
            logger.exception("engine core thread failed")
            self._fail_all(f"engine core failed: {type(exc).__name__}: {exc}")
            return
        self._fail_all("engine is shut down")

    def _on_message(self, message: FromCore) -> None:
        if isinstance(message, StepOutputs):
            self._deliver(message.outputs)
        elif isinstance(message, CallResult):
            self._resolve(message)

    def close(self) -> None:
        """Stops the core thread once it has handled what was sent before."""
        self._inbox.put(None)
        self._thread.join()
