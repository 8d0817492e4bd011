"""The core side of the request stream: what a step added to a `Req`, as a `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.engine.protocol import RequestOutput
from radixserve.engine.request import Req


@dataclass
class _Sent:
    """How much of a request's output its caller has been sent."""

    output: int = 0
    input_logprobs: int = 0
    output_logprobs: int = 0


class DeltaTracker:
    """Remembers what each request's caller has seen; forgets a request once it finished."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def due(self, req: Req, default_interval: int) -> bool:
        """Whether `req`'s caller gets what changed now: its first tokens, its end, and then
        every `stream_interval` tokens (the request's, else `default_interval`)."""
        interval = req.params.stream_interval or default_interval
        if interval <= 1 or req.finished:
            return True
        sent = self._sent.get(req.request_id)
        return sent is None or sent.output == 0 or len(req.output_ids) - sent.output >= interval

    def delta(self, req: Req) -> RequestOutput:
        sent = self._sent.setdefault(req.request_id, _Sent())
        # forced tokens (jump-forward) of a request with logprobs wait for theirs, so that
        # every delta carries as many output tokens as output logprobs (as SGLang's do)
        waits = req.logprob is not None and not req.finished
        num_ready = len(req.output_logprobs) if waits else len(req.output_ids)
        output = RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.output_ids[sent.output : num_ready],
            cached_tokens=req.cached_tokens,
            cached_tokens_host=req.cached_tokens_host,
            queue_time=req.queue_time,
            num_retractions=req.num_retractions,
            finish_reason=req.finish_reason,
            new_input_logprobs=req.input_logprobs[sent.input_logprobs :],
            new_input_top_logprobs=req.input_top_logprobs[sent.input_logprobs :],
            new_output_logprobs=req.output_logprobs[sent.output_logprobs :],
            new_output_top_logprobs=req.output_top_logprobs[sent.output_logprobs :],
            new_input_token_ids_logprobs=req.input_token_ids_logprobs[sent.input_logprobs :],
            new_input_ranks=req.input_ranks[sent.input_logprobs :],
            new_output_token_ids_logprobs=req.output_token_ids_logprobs[sent.output_logprobs :],
            spec_counts=None if req.spec_counts is None else req.spec_counts.copy(),
            jump_forward_tokens=req.jump_forward_tokens,
            embedding=req.embedding if req.finished else None,
        )
        sent.output = num_ready
        sent.input_logprobs = len(req.input_logprobs)
        sent.output_logprobs = len(req.output_logprobs)
        if req.finished:
            del self._sent[req.request_id]
        return output
