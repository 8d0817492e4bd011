"""CoreLoop: the engine core's event loop, the same in a thread (in-process) and in a process.

Each turn it takes every waiting message (new requests, aborts, calls), runs one scheduler
step if there is work, and sends the step's deltas back. It blocks while idle, and backs off
while work exists but no step can make progress (only grammar compiles pending, or prefills
waiting for pages), so it never spins a core. Work finishing off the core thread (a
grammar compile, a disaggregated decode's KV fetch) wakes it through `CoreTransport.wake`,
as a message does.
"""

from __future__ import annotations

import logging
from typing import Protocol

from radixserve.distributed.group import RankFailedError
from radixserve.engine.core import EngineCore
from radixserve.engine.deltas import DeltaTracker
from radixserve.engine.protocol import (
    AbortRequests,
    AddRequests,
    Call,
    CallResult,
    FromCore,
    StepOutputs,
    ToCore,
)
from radixserve.engine.request import Req

logger = logging.getLogger(__name__)

STALL_WAIT_MIN_S = 0.001
STALL_WAIT_MAX_S = 0.05
"""Backoff bounds while work exists but steps make no progress (doubling from min to max)."""


class CoreTransport(Protocol):
    def receive(self, timeout: float | None) -> list[ToCore] | None:
        """Messages that arrived (waiting up to `timeout` s, None: forever); None once closed."""

    def send(self, message: FromCore) -> None: ...

    def wake(self) -> None:
        """Makes a pending (or the next) `receive` return at once; callable from any thread."""


class CoreLoop:
    def __init__(self, core: EngineCore, transport: CoreTransport):
        self.core = core
        self.transport = transport
        self.deltas = DeltaTracker()
        self._stall_wait = 0.0
        core.scheduler.set_wake(transport.wake)

    def run(self) -> None:
        """Serves until the transport closes."""
        while self.run_once(self._timeout()):
            pass

    def run_once(self, timeout: float | None = 0) -> bool:
        """Handles the messages that arrive within `timeout`, then steps once if there is
        work; False once the transport has closed."""
        messages = self.transport.receive(timeout)
        if messages is None:
            return False
        for message in messages:
            self._handle(message)
        if self.core.scheduler.has_work():
            self._step()
        return True

    def _timeout(self) -> float | None:
        if not self.core.scheduler.has_work():
            return None
        return self._stall_wait

    def _step(self) -> None:
        scheduler = self.core.scheduler
        try:
            changed = scheduler.step()
            progressed = scheduler.last_step_progressed
        except RankFailedError:  # the ranks are out of step: the engine cannot go on
            raise
        except Exception as exc:  # a broken step must not take the server down
            logger.exception("engine step failed; aborting every request")
            changed = scheduler.abort_all(f"engine step failed: {type(exc).__name__}: {exc}")
            progressed = True
        wait = min(max(2 * self._stall_wait, STALL_WAIT_MIN_S), STALL_WAIT_MAX_S)
        self._stall_wait = 0.0 if progressed else wait
        interval = self.core.scheduler.config.stream_interval
        outputs = [self.deltas.delta(r) for r in changed if self.deltas.due(r, interval)]
        if outputs:
            self.transport.send(StepOutputs(outputs))

    def _handle(self, message: ToCore) -> None:
        scheduler = self.core.scheduler
        if isinstance(message, AddRequests):
            for spec in message.specs:
                scheduler.add_request(Req.from_spec(spec))
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                scheduler.abort_request(request_id)
        elif isinstance(message, Call):
            self.transport.send(self._call(message))
        self._stall_wait = 0.0  # something new: try a step right away

    def _call(self, call: Call) -> CallResult:
        methods = {
            "flush_cache": self.core.flush_cache,
            "get_stats": self.core.get_stats,
            "check_integrity": self.core.check_integrity,
            "list_pins": self.core.list_pins,
            "unpin": self.core.unpin,
            "tree_summary": self.core.tree_summary,
            "tree_outline": self.core.tree_outline,
            "load_lora_adapter": self.core.load_lora_adapter,
            "unload_lora_adapter": self.core.unload_lora_adapter,
        }
        if call.method not in methods:
            return CallResult(call.call_id, error=f"unknown method {call.method!r}")
        try:
            return CallResult(call.call_id, value=methods[call.method](**call.args))
        except Exception as exc:  # reported to the caller, the core keeps serving
            return CallResult(call.call_id, error=f"{type(exc).__name__}: {exc}")
