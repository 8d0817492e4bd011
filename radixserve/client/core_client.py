"""MultiprocessClient: the EngineClient whose core runs in its own process (`radixserve serve`).

Messages go out through a writer thread (a large batch never blocks the event loop on the
pipe) and come back on the event loop, which routes each delta to its stream. If the core
process exits, every stream and call fails with EngineDeadError at once and `on_dead`
callbacks run (the server then answers 503 and exits).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from typing import Any

from radixserve.client.client import EngineClient, EngineDeadError
from radixserve.client.core_start import CORE_ENV_DEFAULTS, choose_start_method
from radixserve.engine.core_process import run_core, run_forked_core
from radixserve.engine.protocol import CallResult, Ready, StartFailed, StepOutputs
from radixserve.engine.wire import decode_from_core, encode

logger = logging.getLogger(__name__)


class MultiprocessClient(EngineClient):
    def __init__(self, engine_kwargs: dict[str, Any], log_level: str = "warning"):
        super().__init__()
        self.engine_kwargs = engine_kwargs
        self.log_level = log_level
        self.info: dict[str, Any] = {}
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_reason = ""

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Starts the core (fork or spawn: client/core_start.py) and blocks until it has
        loaded the model; returns its info."""
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Starts the core process and returns at once (`start`'s first half: this process
        may do its own start-up work, in threads too, while the core loads)."""
        for name, value in CORE_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)  # read by a spawned child's OpenMP at start
        choice = choose_start_method()
        ctx = mp.get_context(choice.method)
        self._conn, child = ctx.Pipe()
        # a daemonic process may not start processes: with --tp-size > 1 the core spawns its
        # ranks, so it is not daemonic then (close() still joins or terminates it)
        daemon = self.engine_kwargs.get("tp_size", 1) == 1
        args = (child, self.engine_kwargs, self.log_level)
        if choice.method == "fork":  # the forked core closes its copy of this process's end
            target, args = run_forked_core, (self._conn, *args)
        else:
            target = run_core
            logger.info("engine core: spawn (%s)", choice.reason)
        self._process = ctx.Process(target=target, args=args, daemon=daemon)
        self._process.start()
        child.close()
        self._start_reason = choice.reason

    def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Blocks until the launched core has loaded the model; returns its info."""
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            # a core that failed sends StartFailed and then exits: it may do both between the
            # poll above and this check, so a dead core's pipe is read once more before EOF
            if not self._process.is_alive() and not self._conn.poll(0):
                raise EngineDeadError(f"engine core exited with code {self._process.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine core not ready after {timeout_s:.0f}s")
        try:
            ready = decode_from_core(self._conn.recv_bytes())
        except EOFError:  # it died without a word (killed, out of memory)
            self._process.join(timeout=10)
            code = self._process.exitcode
            raise EngineDeadError(f"engine core exited with code {code} while starting") from None
        if isinstance(ready, StartFailed):
            self._process.join(timeout=10)
            raise EngineDeadError(f"engine core failed to start: {ready.error}")
        assert isinstance(ready, Ready)
        self.info = ready.info
        self.info["core_start"]["reason"] = self._start_reason  # why not fork, for spawn
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts routing core messages on `loop` and a thread that writes to the core."""
        self._loop = loop
        loop.add_reader(self._conn.fileno(), self._on_readable)
        threading.Thread(target=self._send_loop, name="core-writer", daemon=True).start()

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        self._outbox.put(None)
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and not self.dead

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # ---- plumbing ------------------------------------------------------------------------

    def _send(self, message) -> None:
        self._outbox.put(encode(message))

    def _send_loop(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:
                return

    def _on_readable(self) -> None:
        try:
            message = decode_from_core(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._loop.remove_reader(self._conn.fileno())
            self._process.join(timeout=1)
            self._fail_all(f"engine core process exited (code {self._process.exitcode})")
            return
        if isinstance(message, StepOutputs):
            self._deliver(message.outputs)
        elif isinstance(message, CallResult):
            self._resolve(message)
