"""KVHandoff: the scheduler's one handle on prefill/decode disaggregation (radixserve/disagg).

A prefill worker runs each request for one token (SGLang's prefill server answers after the
prefill) and, when a request with a bootstrap room finishes, publishes its prompt's whole KV
pages under the room. A decode worker parks a request with a bootstrap room off the queue
while a thread fetches its pages, then stores them into its pool and radix tree and queues
it: admission matches them like any cached prefix. The stored pages are held (locked,
engine/req_pages.py) until the request is admitted or leaves, so that LRU eviction does not
take them meanwhile; only an allocation eviction cannot otherwise serve makes a hold give
way, and the request then computes its prompt itself (slower, same tokens). A request with no room
(warm-up, a client calling the worker directly) is computed as on a normal worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from radixserve.config import DisaggregationConfig
from radixserve.disagg.worker import DecodeReceiver, PrefillSender, create_transfer
from radixserve.engine.req_pages import ReqPages
from radixserve.engine.request import Req
from radixserve.engine.stats import EngineStats

logger = logging.getLogger(__name__)


def _no_wake() -> None:
    """Driven step by step (tests, lockstep): nothing to wake."""


class KVHandoff:
    def __init__(self, config: DisaggregationConfig, pages: ReqPages, stats: EngineStats):
        self.mode = config.mode
        self.pages = pages
        self.stats = stats
        transfer = create_transfer(config, pages.pool)
        self.sender = None
        if self.mode == "prefill" and transfer.moves_pages:
            self.sender = PrefillSender(transfer, pages.pool)
        self.receiver = None
        if self.mode == "decode":
            timeout = config.disaggregation_transfer_timeout
            self.receiver = DecodeReceiver(transfer, pages.pool, pages.cache, timeout)
        self._transfer = transfer
        self.wake: Callable[[], None] = _no_wake  # the core loop's, once it runs

    @classmethod
    def create(
        cls, config: DisaggregationConfig | None, pages: ReqPages, stats: EngineStats
    ) -> KVHandoff | None:
        """None on a normal worker (no --disaggregation-mode)."""
        if config is None or config.mode is None:
            return None
        return cls(config, pages, stats)

    @property
    def bootstrap_port(self) -> int | None:
        """The port a tcp prefill worker serves its KV on (None elsewhere)."""
        return self._transfer.port

    def prepare(self, req: Req) -> bool:
        """A new request: prefill caps it at one token; decode starts fetching its room's
        KV. True: the request waits for `req.kv_future` before it may queue."""
        if self.mode == "prefill":
            req.params = replace(req.params, max_new_tokens=1, min_new_tokens=0)
            return False
        if req.bootstrap is None:
            return False
        b = req.bootstrap
        req.kv_future = self.receiver.fetch(b.host, b.port, b.room, req.input_ids)
        req.kv_future.add_done_callback(lambda _: self.wake())  # no polling delay on arrival
        return True

    def receive(self, req: Req) -> None:
        """Stores a fetched room's pages (the future is done) and holds them for `req` until
        it is admitted; raises KVTransferError when the fetch failed. Pages short even after
        eviction: the request computes its prompt."""
        pages, req.kv_future = req.kv_future.result(), None
        if not pages:  # the fake backend, or a prompt shorter than a page
            return
        if not self.pages.ensure_free(len(pages), take_holds=False):
            logger.warning("no room for %d received KV pages of %s", len(pages), req.rid)
            return
        num_tokens = self.receiver.store(req.bootstrap.room, req.input_ids, pages, req.namespace)
        self.pages.hold(req, req.input_ids[:num_tokens])
        self.stats.kv_pages_received += len(pages)
        self.stats.kv_bytes_received += sum(len(p) for p in pages)

    def on_finished(self, req: Req) -> None:
        """Prefill: publishes a finished (not aborted) request's prompt pages under its room;
        called while the request still holds its pages."""
        if self.sender is None or req.bootstrap is None or req.finish_reason.is_abort:
            return
        prompt_len = min(len(req.input_ids), req.num_computed)
        pages = self.sender.send(req.bootstrap.room, req.input_ids, prompt_len, req.page_table)
        self.stats.kv_pages_sent += len(pages)
        self.stats.kv_bytes_sent += sum(len(p) for p in pages)

    def report_aborted(self, reqs: list[Req]) -> None:
        """Prefill: tells the decode side at once that an aborted request's room will never
        get its pages (instead of letting it wait out its timeout). Decode: abandons an
        aborted request's fetch, so that the prefill side drops its room."""
        if self.receiver is not None:
            for req in reqs:
                if req.kv_future is not None and req.finished and req.finish_reason.is_abort:
                    self.receiver.cancel(req.kv_future)
                    req.kv_future = None
            return
        if self.sender is None:
            return
        for req in reqs:
            if req.bootstrap is not None and req.finished and req.finish_reason.is_abort:
                room = req.bootstrap.room
                message = f"the prefill worker aborted bootstrap_room {room}"
                self.sender.transfer.publish_error(room, f"{message}: {req.finish_reason.message}")

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        else:
            self._transfer.close()
