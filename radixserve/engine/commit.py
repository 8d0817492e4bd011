"""Committer: writes one forward's results into the requests that ran in it.

A plain request gets its sampled token (or, mid-prefill, none), a speculating one the
accepted prefix of its draft plus the target's token; then logprobs, finish checks and
jump-forward. A request that goes on keeps its K/V in step with its tokens (computed full
pages offered to the tree, a rejected draft's pages trimmed, sliding K/V before its window
freed); one that finished is left to the scheduler, which takes it out of the batch.
"""

from __future__ import annotations

import itertools
import logging

import torch

from radixserve.engine.batch_builder import Work
from radixserve.engine.faults import FaultInjector
from radixserve.engine.jump_forward import JumpForward
from radixserve.engine.logprobs import commit_logprobs
from radixserve.engine.protocol import FinishReason
from radixserve.engine.req_pages import ReqPages
from radixserve.engine.speculative import Speculator, Verified, Verifier
from radixserve.engine.stats import EngineStats
from radixserve.engine.token_sampler import TokenSampler
from radixserve.model.runner import LogitsOutput

logger = logging.getLogger(__name__)


class Committer:
    def __init__(
        self,
        sampler: TokenSampler,
        verifier: Verifier,
        speculator: Speculator | None,
        jumps: JumpForward,
        pages: ReqPages,
        stats: EngineStats,
        faults: FaultInjector | None,
    ):
        self.sampler = sampler
        self.verifier = verifier
        self.speculator = speculator
        self.jumps = jumps
        self.pages = pages
        self.stats = stats
        self.faults = faults

    def sample(self, work: list[Work], logits: LogitsOutput) -> dict[int, int]:
        """The next token of each work that completes its sequence without a draft, by index
        in `work` (a failed sampling finishes its request instead)."""
        sampling = [
            i
            for i, w in enumerate(work)
            if not w.draft and w.num_new == w.req.num_uncomputed and w.req.params.max_new_tokens > 0
        ]
        last = logits.last
        if len(sampling) < len(work):
            last = last[torch.tensor(sampling, dtype=torch.int64, device=last.device)]
        next_ids = self.sampler.sample_each([work[i].req for i in sampling], last)
        return dict(zip(sampling, next_ids))

    def verify(self, work: list[Work], logits) -> dict[int, tuple[Verified, torch.Tensor]]:
        """Each drafting work's outcome and its verify rows' logits, by index in `work`; a
        failed verification aborts its requests (the batch goes on)."""
        index = [i for i, w in enumerate(work) if w.draft]
        if not index:
            return {}
        reqs, drafts = [work[i].req for i in index], [work[i].draft for i in index]
        probs = [work[i].draft_probs for i in index]
        parents = [work[i].draft_parents for i in index]
        try:
            results = self.verifier.verify(reqs, drafts, logits, probs, parents)
        except Exception as exc:
            logger.exception("verifying drafts failed; aborting %d requests", len(reqs))
            for req in reqs:
                req.finish(FinishReason.abort(f"verifying drafts failed: {exc}", 500))
            return {}
        starts = itertools.accumulate((len(d) + 1 for d in drafts), initial=0)
        rows = [logits[start : start + len(d) + 1] for start, d in zip(starts, drafts)]
        return dict(zip(index, zip(results, rows)))

    def commit_sampled(
        self, w: Work, token: int | None, logits: LogitsOutput, index: int, offset: int
    ) -> None:
        """A plain work: its computed tokens counted, then its sampled token (if any)."""
        req = w.req
        if self.faults is not None:
            self.faults.check("commit", [req.rid])
        self._count_computed(w)
        if req.logprob is not None:
            all_rows = None if logits.all is None else logits.all[offset : offset + w.num_new]
            commit_logprobs(req, req.num_computed, all_rows, logits.last[index], token)
        req.num_computed += w.num_new
        if token is not None:
            req.output_ids.append(token)
            self.sampler.check_finish(req, token)
            self.jumps.after_token(req, logits.last[index])
        elif req.num_uncomputed == 0:  # max_new_tokens == 0: prefill into the cache only
            if req.embed:
                req.embedding = logits.hidden[index].cpu().numpy().astype("<f4").tobytes()
            req.finish(FinishReason.of_length(0))
        if not req.finished and w.num_new > 1:
            self.pages.cache_unfinished(req)
        if not req.finished:
            self.pages.free_out_of_window(req)

    def commit_verified(self, w: Work, verified: Verified, rows: torch.Tensor) -> None:
        """Appends the accepted drafts and the target's token, up to the first that ends the
        request; the K/V of what was not kept is dropped (pages past it freed)."""
        req = w.req
        if self.faults is not None:
            self.faults.check("commit", [req.rid])
        if verified.path is not None:  # a tree: the rows of the root and the kept nodes
            rows = rows[torch.tensor([0, *verified.path], device=rows.device)]
        num_emitted = 0
        for token in verified.tokens:
            if req.logprob is not None:
                commit_logprobs(req, req.num_computed, None, rows[num_emitted], token)
            req.output_ids.append(token)
            num_emitted += 1
            self.sampler.check_finish(req, token)
            if req.finished:
                break
        if verified.path is not None:  # a tree: the kept nodes' K/V to their positions
            self._compact_path(w, verified.path[: num_emitted - 1])
        # K/V now covers the last token and every kept token but the newest
        req.num_computed += num_emitted
        self.stats.decode_tokens += num_emitted
        self.speculator.record(w, min(verified.num_accepted, num_emitted))
        self.jumps.after_token(req, rows[num_emitted - 1])
        if not req.finished:
            self.pages.trim(req)
            self.pages.free_out_of_window(req)

    def _compact_path(self, w: Work, path: list[int]) -> None:
        """A tree's node j was computed at position root + j; the kept drafts, path[d - 1]
        at depth d, must own position root + d (sources come after their destinations, so
        copying all at once is safe). The rest stays past the sequence: trimmed or
        overwritten, never offered to the tree."""
        req, pool = w.req, self.pages.pool
        root = req.num_computed + w.num_new - 1
        moves = [(root + node, root + d) for d, node in enumerate(path, start=1) if node != d]
        if not moves:
            return
        size, table = pool.page_size, req.page_table
        src = [table[pos // size] * size + pos % size for pos, _ in moves]
        dst = [table[pos // size] * size + pos % size for _, pos in moves]
        pool.copy_slots(src, dst)

    def _count_computed(self, w: Work) -> None:
        if w.num_new > 1 or not w.req.output_ids:
            self.stats.prefill_tokens_computed += w.num_new
        else:
            self.stats.decode_tokens += w.num_new
            if w.req.spec_counts is not None:  # a decode without a draft verifies none
                self.speculator.record(w, 0)
