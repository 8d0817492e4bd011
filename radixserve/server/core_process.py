"""The engine core process: receives requests over a pipe, steps the scheduler, sends deltas.

It never parses HTTP or touches JSON, so the server's event loop and the model's forward
passes do not contend for one GIL.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from radixserve.config import split_engine_kwargs
from radixserve.engine.core import EngineCore
from radixserve.engine.request import LogprobRequest, Req
from radixserve.sampling.params import SamplingParams
from radixserve.server.protocol import (
    AbortRequest,
    AddRequest,
    Call,
    CallResult,
    Ready,
    ReqUpdate,
    StepUpdates,
    decode_to_core,
    encode,
)

logger = logging.getLogger(__name__)
IDLE_POLL_S = 1.0


def run_core(conn: Connection, engine_kwargs: dict[str, Any], log_level: str = "warning") -> None:
    """Process entry point: build the core, announce it, serve until the pipe closes."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s core: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server process decides when to stop
        signal.signal(sig, signal.SIG_IGN)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    core = EngineCore.build(*split_engine_kwargs(None, dict(engine_kwargs)))
    conn.send_bytes(encode(Ready(info=core_info(core))))
    CoreLoop(core, conn).run()


def core_info(core: EngineCore) -> dict[str, Any]:
    pool = core.runner.pool
    return {
        "model_name": core.loaded.name,
        "tokenizer_path": core.tokenizer.name_or_path,  # the default model's, when borrowed
        "architecture": core.loaded.config.architecture,
        "vocab_size": core.loaded.config.vocab_size,
        "context_length": core.context_length,
        "capacity_tokens": pool.capacity_tokens,
        "page_size": pool.page_size,
        "device": str(core.runner.device),
        "dtype": str(pool.dtype).removeprefix("torch."),
    }


@dataclass
class _Sent:
    """How much of a request's output the server has already been sent."""

    output: int = 0
    input_logprobs: int = 0
    output_logprobs: int = 0


class CoreLoop:
    def __init__(self, core: EngineCore, conn: Connection):
        self.core = core
        self.conn = conn
        self.sent: dict[int, _Sent] = {}

    def run(self) -> None:
        while self._receive(0 if self.core.scheduler.has_work() else IDLE_POLL_S):
            changed = self.core.scheduler.step()
            if changed:
                self.conn.send_bytes(encode(StepUpdates([self._update(r) for r in changed])))

    def _receive(self, timeout: float) -> bool:
        """Handles every waiting message; False once the server side has closed the pipe."""
        try:
            while self.conn.poll(timeout):
                self._handle(decode_to_core(self.conn.recv_bytes()))
                timeout = 0
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, message) -> None:
        if isinstance(message, AddRequest):
            self.core.scheduler.add_request(_to_req(message))
        elif isinstance(message, AbortRequest):
            self.core.scheduler.abort_request(message.rid)
        elif isinstance(message, Call):
            self.conn.send_bytes(encode(self._call(message)))

    def _call(self, call: Call) -> CallResult:
        methods = {
            "flush_cache": self.core.flush_cache,
            "get_stats": self.core.get_stats,
            "check_integrity": self.core.check_integrity,
        }
        if call.method not in methods:
            return CallResult(call.call_id, error=f"unknown method {call.method!r}")
        try:
            return CallResult(call.call_id, value=methods[call.method]())
        except Exception as exc:  # reported to the caller, the core keeps serving
            return CallResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _update(self, req: Req) -> ReqUpdate:
        sent = self.sent.setdefault(id(req), _Sent())
        update = ReqUpdate(
            rid=req.rid,
            new_output_ids=req.output_ids[sent.output :],
            cached_tokens=req.cached_tokens,
            finish_reason=req.finish_reason,
            queue_time=req.queue_time,
            new_input_logprobs=req.input_logprobs[sent.input_logprobs :],
            new_input_top_logprobs=req.input_top_logprobs[sent.input_logprobs :],
            new_output_logprobs=req.output_logprobs[sent.output_logprobs :],
            new_output_top_logprobs=req.output_top_logprobs[sent.output_logprobs :],
        )
        sent.output = len(req.output_ids)
        sent.input_logprobs = len(req.input_logprobs)
        sent.output_logprobs = len(req.output_logprobs)
        if req.finished:
            del self.sent[id(req)]
        return update


def _to_req(message: AddRequest) -> Req:
    logprob = None
    if message.logprob_start_len is not None:
        logprob = LogprobRequest(message.logprob_start_len, message.top_logprobs_num)
    return Req(
        rid=message.rid,
        input_ids=message.input_ids,
        params=SamplingParams.from_dict(message.sampling_params),
        seed=message.seed,
        namespace=message.namespace,
        logprob=logprob,
    )
