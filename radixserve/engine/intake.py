"""Intake: where a request waits between `add_request` and the waiting queue.

    add_request ─> inbox ─┬──────────────────────────────┬─> waiting (admission picks from it)
                          ├─> receiving (disaggregated   │
                          │   decode: its KV on the way) ┤
                          └─> compiling (its grammar) ───┘

Each step drains the inbox and moves the requests whose grammar compiled or whose KV arrived
on to the waiting queue; neither wait ever stalls the running batch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from radixserve.engine.jump_forward import JumpForward
from radixserve.engine.kv_handoff import KVHandoff
from radixserve.engine.protocol import FinishReason, SpecCounts
from radixserve.engine.req_pages import ReqPages
from radixserve.engine.request import Req
from radixserve.engine.stats import EngineStats
from radixserve.sampling.grammar import GrammarBackend

logger = logging.getLogger(__name__)


class Intake:
    """The inbox and the two waits before the queue: grammars compiling, KV arriving."""

    def __init__(
        self,
        stats: EngineStats,
        pages: ReqPages,
        jumps: JumpForward,
        handoff: KVHandoff | None,
        grammar: Callable[[], GrammarBackend],
    ):
        self.inbox: deque[Req] = deque()
        self.compiling: list[Req] = []  # constrained requests whose grammar is compiling
        self.receiving: list[Req] = []  # disaggregated decode: requests whose KV is on its way
        self.wake: Callable[[], None] | None = None  # the core loop's (Scheduler.set_wake)
        self._stats = stats
        self._pages = pages
        self._jumps = jumps
        self._handoff = handoff
        self._grammar = grammar
        self.lora = None  # the model's LoRA weights (BatchBuilder's): the load ids it holds

    def reqs(self) -> list[Req]:
        return [*self.inbox, *self.receiving, *self.compiling]

    def clear(self) -> None:
        self.inbox.clear()
        self.compiling, self.receiving = [], []

    def pending_compiles(self) -> list[Future]:
        return [r.grammar_future for r in self.compiling]

    def drain(self, waiting: list[Req], outputs: list[Req], speculating: bool) -> None:
        """Counts the inbox's requests in and sends each on to `waiting` or a wait; ends
        (into `outputs`) those whose LoRA adapter was unloaded on their way here."""
        while self.inbox:
            req = self.inbox.popleft()
            self._stats.num_requests += 1
            self._stats.prompt_tokens += len(req.input_ids)
            if req.lora_id is not None and (self.lora is None or req.lora_id not in self.lora.held):
                message = "lora_path: its LoRA adapter was unloaded before the request ran"
                req.finish(FinishReason.abort(message, status_code=400))
                outputs.append(req)
                continue
            if speculating and req.params.speculative:
                req.spec_counts = SpecCounts()
            if self._handoff is not None and self._handoff.prepare(req):
                self.receiving.append(req)  # waits off the queue while its KV is fetched
            else:
                self._enqueue(req, waiting)

    def _enqueue(self, req: Req, waiting: list[Req]) -> None:
        if req.params.grammar is None:
            if req.params.needs_matcher:  # a reasoning budget alone: nothing to compile
                req.grammar = self._grammar().matcher(None, req.params)
            waiting.append(req)
        else:  # waits off the queue so that compiling never stalls the batch
            req.grammar_future = self._grammar().compile_async(*req.params.grammar)
            if self.wake is not None:  # no polling delay once it compiles
                wake = self.wake
                req.grammar_future.add_done_callback(lambda _: wake())
            self.compiling.append(req)

    def collect_compiled(self, waiting: list[Req], outputs: list[Req]) -> bool:
        """Queues the requests whose grammar compiled (aborts those whose compile failed)."""
        done = [r for r in self.compiling if r.grammar_future.done()]
        for req in done:
            self.compiling.remove(req)
            error = req.grammar_future.exception()
            try:
                if error is not None:
                    raise error
                req.grammar = self._grammar().matcher(req.grammar_future.result(), req.params)
                self._jumps.after_token(req, None)  # a forced opening is prefilled with the prompt
                (outputs if req.finished else waiting).append(req)
            except Exception as exc:
                self._pages.release_hold(req)
                req.finish(FinishReason.abort(f"grammar failed: {exc}", status_code=400))
                outputs.append(req)
            req.grammar_future = None
        return bool(done)

    def collect_received(self, waiting: list[Req], outputs: list[Req]) -> bool:
        """Queues the requests whose KV arrived (stored into the pool and tree first); ends
        those whose transfer failed, with one message naming only their room (whether a port
        is open or a peer lied is no business of the client's)."""
        done = [r for r in self.receiving if r.kv_future.done()]
        for req in done:
            self.receiving.remove(req)
            try:
                self._handoff.receive(req)
            except Exception as exc:  # the detail stays in the log: it may describe the network
                room, peer = req.bootstrap.room, f"{req.bootstrap.host}:{req.bootstrap.port}"
                logger.warning("KV transfer of %s from %s failed: %s", req.rid, peer, exc)
                self._stats.kv_transfer_failures += 1
                message = f"KV transfer for bootstrap_room {room} failed"
                req.finish(FinishReason.abort(message, status_code=500))
                outputs.append(req)
                continue
            self._enqueue(req, waiting)
        return bool(done)
