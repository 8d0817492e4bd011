"""Speculator: the scheduler's side of speculative decoding behind one small interface:
which decodes carry a draft this step (`add_drafts`), what verification taught
(`record`), and a request leaving the batch (`on_left`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from radixserve.config import SchedulerConfig
from radixserve.engine.batch_builder import Work
from radixserve.engine.request import Req
from radixserve.engine.speculative.adaptive import (
    CPU_VERIFY_ROW_COST,
    ROW_COST_MIN_HIDDEN_SIZE,
    AdaptivePolicy,
    RowCostFit,
)
from radixserve.engine.speculative.drafter import Draft, Drafter
from radixserve.engine.stats import EngineStats
from radixserve.model.runner import LogitsOutput, ModelRunner

logger = logging.getLogger(__name__)

NO_DRAFT = "none"  # meta_info's name for the decode steps of a request without a draft


class Speculator:
    def __init__(
        self, drafter: Drafter, config: SchedulerConfig, stats: EngineStats, target: ModelRunner
    ):
        """On CPU a verify row's cost is learnt from the `target`'s steps (`row_costs`: from
        add_drafts to on_forward, drafting, batch building and the forward;
        CPU_VERIFY_ROW_COST until measured, and for a model narrower than
        ROW_COST_MIN_HIDDEN_SIZE), elsewhere taken as 0."""
        self.drafter = drafter
        self.stats = stats
        cpu = target.device.type == "cpu"
        learns = cpu and target.config.hidden_size >= ROW_COST_MIN_HIDDEN_SIZE
        self.row_costs = RowCostFit(CPU_VERIFY_ROW_COST) if learns else None
        self.policy = AdaptivePolicy(
            config.speculative_adaptive_threshold,
            config.speculative_disable_by_batch_size,
            CPU_VERIFY_ROW_COST if cpu else 0.0,
        )
        self._step_start: float | None = None

    def add_drafts(
        self,
        decodes: list[Work],
        grow_from_free: Callable[[Req, int], bool],
        valid_draft: Callable[[Req, list[int]], list[int]],
    ) -> None:
        """Gives each speculating decode that the adaptive policy lets draft a draft to
        verify, while free pages last (`grow_from_free`: a draft never evicts the cache or
        causes a retraction). Drafts stop at max_new_tokens and where a grammar forbids."""
        self._step_start = time.perf_counter()
        if self.row_costs is not None:
            self.policy.row_cost = self.row_costs.row_cost(len(decodes))
        if not self.policy.batch_speculates(len(decodes)):
            return
        chosen = [w for w in decodes if _room(w.req) > 0 and self.policy.should_draft(w.req)]
        num_draft_tokens = self.drafter.num_draft_tokens
        limits = [min(_room(w.req), self.policy.draft_limit(w.req, num_draft_tokens))
                  for w in chosen]  # fmt: skip
        try:
            drafts = self.drafter.propose_all([w.req for w in chosen], limits) if chosen else []
        except Exception:  # drafts only save time: decode without them this step
            logger.exception("drafting failed; %d requests decode without a draft", len(chosen))
            return
        for w, draft, limit in zip(chosen, drafts, limits):
            req = w.req
            draft = draft.cut(limit)
            if draft.parents is not None and req.grammar is not None:  # each path's prefix
                draft = draft.keep([len(valid_draft(req, p)) == len(p) for p in draft.paths()])
            elif draft.tokens and req.grammar is not None:
                draft = draft.cut(len(valid_draft(req, draft.tokens)))
            if draft.tokens and grow_from_free(req, w.num_new + len(draft.tokens)):
                w.draft, w.draft_probs = draft.tokens, draft.probs
                w.draft_parents = draft.parents
                w.draft_source = draft.source or self.drafter.algorithm

    def on_forward(self, work: list[Work], logits: LogitsOutput) -> None:
        """A target forward ran (before its commit): the drafter may keep what it needs; a
        decode-only step's seconds teach the verify cost."""
        if self.row_costs is not None and self._step_start is not None:
            if all(w.num_new == 1 for w in work):
                seconds = time.perf_counter() - self._step_start
                self.row_costs.observe(len(work), sum(w.num_forward for w in work), seconds)
            self._step_start = None
        reqs, starts = [w.req for w in work], [w.req.num_computed for w in work]
        trees = [
            Draft(w.draft, None, w.draft_parents) if w.draft and w.draft_parents else None
            for w in work
        ]
        lengths = [w.num_forward for w in work]
        self.drafter.on_forward(reqs, starts, lengths, logits, trees if any(trees) else None)

    def record(self, w: Work, num_accepted: int) -> None:
        """Counts one decode step of a speculating request (its draft may be empty): the
        drafter learns from it, then the adaptive policy from what the drafter says it
        shows (AUTO: the best of its candidates)."""
        num_draft = len(w.draft)
        source = (w.draft_source or self.drafter.algorithm) if num_draft else NO_DRAFT
        w.req.spec_counts.count(source, num_draft, num_accepted)
        self.stats.spec_verify_steps += 1
        self.stats.spec_draft_tokens += num_draft
        self.stats.spec_accepted_tokens += num_accepted
        judged = self.drafter.on_verified(w.req, num_draft, num_accepted)
        self.policy.record(w.req, num_draft, judged)

    def on_left(self, req: Req, finished: bool) -> None:
        """A request left the batch: a finished one teaches the drafter; its state goes."""
        if finished:
            self.drafter.on_finished(req)
        self.drafter.release(req)


def _room(req: Req) -> int:
    """Draft tokens the request may still keep: one of its remaining tokens is the target's."""
    return req.params.max_new_tokens - len(req.output_ids) - 1
