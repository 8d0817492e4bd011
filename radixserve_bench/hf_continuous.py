"""The HF baseline with transformers' own continuous batching (`init_continuous_batching`):
requests join the running batch between steps, its paged cache shares whole prefix blocks
between requests, and each request's tokens stream out as they are made.

    submit ──> manager.add_request(streaming) ──> [transformers' scheduler thread]
    dispatcher thread <── manager.get_result()  (cumulative generated_tokens per request)
          ──> new tokens ──> HFRequest.steps (as the static batcher's)

Configured as its documentation recommends for a machine without a GPU to size it from:
explicit cache blocks (`num_blocks`), a per-step token budget (`max_batch_tokens`, like our
chunked prefill), a request cap per batch, and a scheduler. transformers reports no
per-request prefix hit, so `PrefixHitRecorder` wraps its cache's `search_prefix_match` in
this (the server's own) process to report honest cached-token counts.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from radixserve_bench.hf_batcher import HFModel, HFRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContinuousConfig:
    """The knobs transformers' continuous batching asks for when it cannot size from a GPU."""

    page_size: int = 64
    num_blocks: int = 512
    max_batch_tokens: int = 2048
    max_requests_per_batch: int = 16
    scheduler: str = "fifo"


class PrefixHitRecorder:
    """Prompt tokens each request found in transformers' paged cache (its prefix sharing)."""

    def __init__(self):
        self.hits: dict[str, int] = {}
        self.lock = threading.Lock()

    def install(self) -> None:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache

        original = PagedAttentionCache.search_prefix_match

        def search_prefix_match(cache, request_id: str, prompt_ids: list[int]) -> int:
            matched = original(cache, request_id, prompt_ids)
            with self.lock:
                self.hits[request_id] = self.hits.get(request_id, 0) + matched
            return matched

        PagedAttentionCache.search_prefix_match = search_prefix_match

    def pop(self, request_id: str) -> int:
        with self.lock:
            return self.hits.pop(request_id, 0)


class ContinuousBatcher:
    """transformers' continuous batching manager behind the static batcher's interface.
    A client that leaves does not cancel its request: it runs to its end."""

    def __init__(self, hf: HFModel, config: ContinuousConfig):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.hf, self.config = hf, config
        self.recorder = PrefixHitRecorder()
        self.recorder.install()
        cb = ContinuousBatchingConfig(
            page_size=config.page_size,
            num_blocks=config.num_blocks,
            max_batch_tokens=config.max_batch_tokens,
            max_requests_per_batch=config.max_requests_per_batch,
            scheduler_type=config.scheduler,
            auto_switch_to_flash=False,  # no flash-attn on CPU; sdpa is what it runs
        )
        gen = GenerationConfig(do_sample=False, max_new_tokens=1, eos_token_id=-1)
        self.manager = hf.model.init_continuous_batching(gen, continuous_batching_config=cb)
        self.requests: dict[str, HFRequest] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.num_batches = 0  # transformers' steps are not counted here
        self.num_requests = 0
        self.thread = threading.Thread(target=self._dispatch, name="hf-cb-dispatch", daemon=True)

    def start(self) -> None:
        import torch

        with torch.inference_mode():  # its thread inherits the caller's inference mode
            self.manager.start()
        self.thread.start()

    def submit(self, req: HFRequest) -> None:
        with self.lock:
            self.num_requests += 1
            request_id = f"bench_{self.num_requests}"
            self.requests[request_id] = req
        eos = -1 if req.ignore_eos else sorted(self.hf.eos_ids)
        self.manager.add_request(req.input_ids, request_id, req.max_new_tokens, streaming=True,
                                 eos_token_id=eos)  # fmt: skip

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops transformers' thread; every unfinished request is aborted."""
        self.stopping.set()
        self.manager.stop(block=True, timeout=timeout_s, hard_stop=True)
        self.thread.join(timeout_s)
        with self.lock:
            pending, self.requests = list(self.requests.values()), {}
        for req in pending:
            if not req.finished:
                req.abort("the server is shutting down")

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.manager.is_running()

    def _dispatch(self) -> None:
        while not self.stopping.is_set():
            output = self.manager.get_result(timeout=0.5)
            if output is not None:
                self._deliver(output)

    def _deliver(self, output) -> None:
        with self.lock:
            req = self.requests.get(output.request_id)
        if req is None or req.finished:
            return
        if req.num_generated == 0:
            req.cached_tokens = self.recorder.pop(output.request_id)
        if output.error is not None:
            req.abort(f"generation failed: {output.error}")
        for token in output.generated_tokens[req.num_generated :]:
            if not req.finished:
                req.add_token(token, self.hf.eos_ids)
        if output.is_finished() and not req.finished:
            req.abort(f"transformers ended the request after {req.num_generated} tokens")
        if req.finished:
            with self.lock:
                self.requests.pop(output.request_id, None)
