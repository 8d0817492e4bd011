"""TokenSampler: the next token of every request that samples this step, and whether that
token ends the request (grammar, EOS, stop ids and strings, length).

Sampling is batched; if the batch fails (a sampling edge case, a grammar mask), each request
is sampled alone, so that only the requests that fail end, with an abort naming the error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from radixserve.engine.faults import FaultInjector
from radixserve.engine.protocol import FinishReason
from radixserve.engine.request import Req
from radixserve.engine.stop import (
    STOP_REGEX_TIMEOUT_S,
    StopRegexTimeout,
    stop_regex_hit,
    stop_string_hit,
)
from radixserve.sampling.grammar import GrammarBackend
from radixserve.sampling.sampler import SamplingBatch, is_plain_argmax, sample, sample_argmax

logger = logging.getLogger(__name__)


class TokenSampler:
    def __init__(
        self,
        eos_token_ids: tuple[int, ...],
        tokenizer,
        grammar: Callable[[], GrammarBackend],
        faults: FaultInjector | None = None,
    ):
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.grammar = grammar  # built lazily by the scheduler, on the first constrained request
        self.faults = faults

    def sample_each(self, reqs: list[Req], logits: torch.Tensor) -> list[int | None]:
        """One token per request (logits: [len(reqs), vocab]); None where sampling that
        request failed (it is finished with an abort)."""
        try:
            return self.sample(reqs, logits)
        except Exception:
            logger.exception("batched sampling failed; sampling each request alone")
        tokens: list[int | None] = []
        for i, req in enumerate(reqs):
            try:
                tokens += self.sample([req], logits[i : i + 1])
            except Exception as exc:
                req.finish(FinishReason.abort(f"sampling failed: {exc}", status_code=500))
                tokens.append(None)
        return tokens

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> list[int]:
        if not reqs:
            return []
        if self.faults is not None:
            self.faults.check("sample", (r.rid for r in reqs))
        if all(r.grammar is None and is_plain_argmax(r.params, len(r.output_ids)) for r in reqs):
            return sample_argmax(logits).tolist()  # the common greedy batch, without the build
        batch = SamplingBatch.build(
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.output_ids for r in reqs],
            [r.input_ids for r in reqs],
            [self.min_tokens_stop_ids(r) for r in reqs],
            logits.shape[-1],
            logits.device,
        )
        if any(r.grammar is not None for r in reqs):
            logits = logits.clone()  # masked in place; logprobs read the unmasked logits
            self.grammar().mask_logits(logits, [r.grammar for r in reqs])
        return sample(logits, batch).tolist()

    def _stop_regex_hit(self, req: Req) -> FinishReason | None:
        try:
            matched = stop_regex_hit(req, self.tokenizer)
        except StopRegexTimeout as exc:
            message = f"stop_regex {str(exc)[:80]!r} took longer than {STOP_REGEX_TIMEOUT_S} s"
            return FinishReason.abort(message + " to search the output", status_code=400)
        return None if matched is None else FinishReason.stop(matched)

    def min_tokens_stop_ids(self, req: Req) -> list[int]:
        """Ids blocked while `req` is below min_new_tokens (none once it is past it)."""
        if len(req.output_ids) >= req.params.min_new_tokens:
            return []
        ids = list(req.params.stop_token_ids or [])
        return ids if req.params.ignore_eos else ids + list(self.eos_token_ids)

    def check_finish(self, req: Req, token: int) -> None:
        """Finishes `req` if its newest `token` ends it."""
        params = req.params
        if req.grammar is not None and not req.grammar.accept_token(token):
            req.finish(FinishReason.abort(f"token {token} violates the grammar", status_code=500))
        elif req.grammar is not None and req.grammar.is_terminated():
            req.finish(FinishReason.stop(token))
        elif token in (params.stop_token_ids or ()) or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            req.finish(FinishReason.stop(token))
        elif params.stop and (matched := stop_string_hit(req, self.tokenizer)):
            req.finish(FinishReason.stop(matched))
        elif params.stop_regex and (matched := self._stop_regex_hit(req)):
            req.finish(matched)
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finish(FinishReason.of_length(params.max_new_tokens))
