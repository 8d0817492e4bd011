"""InProcessClient: the engine core on a thread of this process (what `Engine` uses).

One core thread runs the CoreLoop for every caller, so requests from many threads and event
loops batch together; deltas reach each stream on its own loop. The thread that built the core
(it loaded the model: OpenMP gave it a team of workers) hands its idle workers back once the
core thread runs, and the core thread hands back its own before it blocks idle, so that one
team steps a model while others wait (native/openmp.py says why that matters: several
engines in one process, as benchmarks and tests make them, each keep a core thread).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from radixserve.client.client import EngineClient
from radixserve.engine.core import EngineCore
from radixserve.engine.core_loop import CoreLoop
from radixserve.engine.protocol import CallResult, FromCore, StepOutputs, ToCore
from radixserve.native.openmp import release_thread_team

logger = logging.getLogger(__name__)


_PAUSE = object()
_WAKE = object()


class _QueueTransport:
    """Messages in through a thread-safe queue (None closes, _PAUSE ends the thread's loop
    for a lockstep block, _WAKE only ends a wait); out through a callback."""

    def __init__(self, inbox: queue.SimpleQueue, client: InProcessClient):
        self.inbox = inbox
        self.client = client
        self.paused = False
        self.idle_releases = 0  # times the core thread handed back its OpenMP team, idle

    def receive(self, timeout: float | None) -> list[ToCore] | None:
        if timeout is None:  # idle until a message: another engine's core may step meanwhile
            self.idle_releases += release_thread_team()
        try:
            first = self.inbox.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return []
        messages = [first]
        while not self.inbox.empty() and messages[-1] is not _PAUSE:
            messages.append(self.inbox.get_nowait())
        if messages[-1] is _PAUSE:
            self.paused = True
            messages.pop()
            for message in messages:  # handled by the lockstep driver's first step
                self.inbox.put(message)
            return None
        if any(m is None for m in messages):
            return None
        return [m for m in messages if m is not _WAKE]

    def send(self, message: FromCore) -> None:
        self.client._on_message(message)

    def wake(self) -> None:
        self.inbox.put(_WAKE)


class InProcessClient(EngineClient):
    def __init__(self, core: EngineCore):
        super().__init__()
        self.core = core
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._transport = _QueueTransport(self._inbox, self)
        self._loop = CoreLoop(core, self._transport)
        self._thread: threading.Thread | None = None
        self._start_thread()
        self.released_caller_team = release_thread_team()

    @contextmanager
    def lockstep(self) -> Iterator[InProcessClient]:
        """Stops the core thread for the block: inside it only `step()` advances the core
        (drivers that act between steps, e.g. the offline benchmark's follow-up turns)."""
        self._stop_thread()
        try:
            yield self
        finally:
            release_thread_team()  # the steps ran on this thread's team
            self._start_thread()

    def step(self) -> None:
        """Handles what was sent, then runs one scheduler step (inside `lockstep()` only)."""
        if self._thread is not None:
            raise RuntimeError("step() advances the core only inside lockstep()")
        self._loop.run_once(0)

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="radixserve-core", daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        self._inbox.put(_PAUSE)
        self._thread.join()
        self._thread = None

    def _send(self, message) -> None:
        self._inbox.put(message)

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as exc:
            logger.exception("engine core thread failed")
            self._fail_all(f"engine core failed: {type(exc).__name__}: {exc}")
            return
        if self._transport.paused:
            self._transport.paused = False
        else:
            self._fail_all("engine is shut down")

    def _on_message(self, message: FromCore) -> None:
        if isinstance(message, StepOutputs):
            self._deliver(message.outputs)
        elif isinstance(message, CallResult):
            self._resolve(message)

    def close(self) -> None:
        """Stops the core thread once it has handled what was sent before."""
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join()
