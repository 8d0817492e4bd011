"""The caller side of the request stream: `RequestResult` accumulates one request's deltas;
`ResultStream` runs a batch of specs and yields each result as it changes (the one merger
the native API, the OpenAI API and the Engine share)."""

from __future__ import annotations

import logging
import time

from radixserve.client.client import EngineClient
from radixserve.client.detokenizer import IncrementalDetokenizer
from radixserve.engine.faults import FaultInjector
from radixserve.engine.protocol import FinishReason, RequestOutput, RequestSpec, SpecCounts
from radixserve.engine.stop import hold_back_partial_stop, trim_stop

logger = logging.getLogger(__name__)


class RequestResult:
    """What a request has produced so far; `apply` adds one delta."""

    def __init__(self, spec: RequestSpec, tokenizer, faults: FaultInjector | None = None):
        self.spec = spec
        self.tokenizer = tokenizer
        self.faults = faults
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.cached_tokens_host = 0
        self.queue_time: float | None = None
        self.num_retractions = 0
        self.finish_reason: FinishReason | None = None
        self.input_logprobs: list = []
        self.input_top_logprobs: list = []
        self.output_logprobs: list = []
        self.output_top_logprobs: list = []
        self.input_token_ids_logprobs: list = []
        self.output_token_ids_logprobs: list = []
        self.input_ranks: list = []  # with spec.input_ranks: each scored prompt token's rank
        self.spec_counts: SpecCounts | None = None
        self.jump_forward_tokens = 0
        self.embedding: bytes | None = None  # an embed request's hidden state, float32 LE
        self.arrival_time = time.perf_counter()
        self.finish_time: float | None = None
        self.failed = False  # the caller side failed it (detokenizer); the core may still run it
        self._detokenizer: IncrementalDetokenizer | None = None
        self._text = ("", -1)  # (text, len(output_ids) it was computed for)

    def apply(self, delta: RequestOutput) -> None:
        if self.finished:  # failed here; the core's last words no longer matter
            return
        self.output_ids += delta.new_token_ids
        self.cached_tokens = delta.cached_tokens
        self.cached_tokens_host = delta.cached_tokens_host
        self.queue_time = delta.queue_time
        self.num_retractions = delta.num_retractions
        self.input_logprobs += delta.new_input_logprobs
        self.input_top_logprobs += delta.new_input_top_logprobs
        self.output_logprobs += delta.new_output_logprobs
        self.output_top_logprobs += delta.new_output_top_logprobs
        self.input_token_ids_logprobs += delta.new_input_token_ids_logprobs
        self.output_token_ids_logprobs += delta.new_output_token_ids_logprobs
        self.input_ranks += delta.new_input_ranks
        self.spec_counts = delta.spec_counts
        self.jump_forward_tokens = delta.jump_forward_tokens
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.finish_reason is not None:
            self._finish(delta.finish_reason)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def unanswered(self) -> bool:
        """Whether the request ended without an answer: aborted, or not finished."""
        return self.finish_reason is None or self.finish_reason.is_abort

    @property
    def prompt_len(self) -> int:
        return len(self.spec.input_ids)

    def e2e_latency(self) -> float:
        end = self.finish_time if self.finish_time is not None else time.perf_counter()
        return end - self.arrival_time

    def text(self) -> str:
        """The output text so far. While running it never ends in half a character or in what
        may be the start of a stop string; once finished, the matched stop string is trimmed.
        If decoding fails, the request ends with an abort naming the error."""
        text, length = self._text
        if length != len(self.output_ids):
            try:
                text = self._decode()
            except Exception as exc:
                logger.exception("detokenizing %s failed", self.spec.rid)
                self.failed = True
                self._finish(FinishReason.abort(f"detokenizer failed: {exc}", status_code=500))
            self._text = (text, len(self.output_ids))
        return text

    def _decode(self) -> str:
        params = self.spec.params
        if self.faults is not None:
            self.faults.check("detokenize", [self.spec.rid])
        if self.finished:
            ids = self.output_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
            return trim_stop(text, self.finish_reason, params.no_stop_trim, params.stop_strs)
        if self._detokenizer is None:
            self._detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        text = self._detokenizer.update(self.output_ids)
        return text if params.no_stop_trim else hold_back_partial_stop(text, params.stop_strs)

    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.finish_time = time.perf_counter()
        self._text = ("", -1)


class ResultStream:
    """Submits `specs` at once (raising at construction if they cannot be), then yields
    (index, RequestResult) each time a request changes; closing early aborts the rest."""

    def __init__(
        self,
        client: EngineClient,
        specs: list[RequestSpec],
        tokenizer,
        max_active: int | None = None,
    ):
        faults = FaultInjector.from_env()
        self.results = [RequestResult(spec, tokenizer, faults) for spec in specs]
        self.stream = client.submit(specs, max_active)

    def __aiter__(self) -> ResultStream:
        return self

    async def __anext__(self) -> tuple[int, RequestResult]:
        index, delta = await self.stream.__anext__()
        result = self.results[index]
        result.apply(delta)
        return index, result

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def __aenter__(self) -> ResultStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def run(self) -> list[RequestResult]:
        """Runs every request to the end; the results in submission order."""
        async with self:
            async for _, result in self:
                self.settle(result)
        return self.results

    def settle(self, result: RequestResult) -> None:
        """Decodes a finished result's text now and, if decoding failed while the core still
        runs the request, aborts it there."""
        if result.finished:
            result.text()
        if result.failed:
            self.stream.abort_one(self.results.index(result))
