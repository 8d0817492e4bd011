"""The server side of the core process: spawn it, send requests, route its updates.

Each request is tracked as a `Req` in the server process too; the core's deltas are
applied to it, so the same `format_output` serves the Engine and the HTTP API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from radixserve.engine.request import Req, ReqState
from radixserve.server.core_process import run_core
from radixserve.server.protocol import (
    AbortRequest,
    AddRequest,
    Call,
    CallResult,
    Ready,
    ReqUpdate,
    StepUpdates,
    decode_from_core,
    encode,
)

logger = logging.getLogger(__name__)


class CoreDiedError(RuntimeError):
    """The engine core process exited."""


class CoreClient:
    def __init__(self, engine_kwargs: dict[str, Any], log_level: str = "warning"):
        self.engine_kwargs = engine_kwargs
        self.log_level = log_level
        self.info: dict[str, Any] = {}
        self._reqs: dict[str, tuple[Req, asyncio.Queue]] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Spawns the core and blocks until it has loaded the model; returns its info."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=run_core, args=(child, self.engine_kwargs, self.log_level), daemon=True
        )
        self._process.start()
        child.close()
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if not self._process.is_alive():
                raise CoreDiedError(f"engine core exited with code {self._process.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine core not ready after {timeout_s:.0f}s")
        ready = decode_from_core(self._conn.recv_bytes())
        assert isinstance(ready, Ready)
        self.info = ready.info
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts routing core messages on `loop` and a thread that writes to the core."""
        self._loop = loop
        loop.add_reader(self._conn.fileno(), self._on_readable)
        threading.Thread(target=self._send_loop, name="core-writer", daemon=True).start()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        self._outbox.put(None)
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    # ---- requests ------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._reqs)

    def active_rids(self) -> list[str]:
        return list(self._reqs)

    async def stream(self, req: Req) -> AsyncIterator[Req]:
        """Submits `req`; yields it after every update until it finishes (aborts if cancelled)."""
        if req.rid in self._reqs:
            raise ValueError(f"rid {req.rid!r} is already in use")
        updates: asyncio.Queue = asyncio.Queue()
        self._reqs[req.rid] = (req, updates)
        self._send(_add_message(req))
        try:
            while not req.finished:
                await updates.get()
                while not updates.empty():  # several steps arrived: report the latest once
                    updates.get_nowait()
                yield req
        finally:
            self._reqs.pop(req.rid, None)
            if not req.finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        self._send(AbortRequest(rid))

    async def call(self, method: str, timeout_s: float = 30.0) -> Any:
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(Call(call_id, method))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

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
            self._fail_all("engine core process exited")
            return
        if isinstance(message, StepUpdates):
            for update in message.updates:
                self._apply(update)
        elif isinstance(message, CallResult):
            self._resolve(message)

    def _apply(self, update: ReqUpdate) -> None:
        entry = self._reqs.get(update.rid)
        if entry is None:
            return
        req, updates = entry
        req.output_ids.extend(update.new_output_ids)
        req.cached_tokens = update.cached_tokens
        req.queue_time = update.queue_time
        req.input_logprobs.extend(update.new_input_logprobs)
        req.input_top_logprobs.extend(update.new_input_top_logprobs)
        req.output_logprobs.extend(update.new_output_logprobs)
        req.output_top_logprobs.extend(update.new_output_top_logprobs)
        if req.state is ReqState.WAITING:
            req.state = ReqState.RUNNING
        if update.finish_reason is not None:
            req.finish(update.finish_reason)
        updates.put_nowait(update)

    def _resolve(self, result: CallResult) -> None:
        future = self._calls.get(result.call_id)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.value)

    def _fail_all(self, message: str) -> None:
        for req, updates in list(self._reqs.values()):
            req.finish({"type": "abort", "message": message})
            updates.put_nowait(None)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(CoreDiedError(message))


def _add_message(req: Req) -> AddRequest:
    return AddRequest(
        rid=req.rid,
        input_ids=req.input_ids,
        sampling_params=dataclasses.asdict(req.params),
        seed=req.seed,
        namespace=req.namespace,
        logprob_start_len=None if req.logprob is None else req.logprob.start_len,
        top_logprobs_num=0 if req.logprob is None else req.logprob.top_num,
    )
