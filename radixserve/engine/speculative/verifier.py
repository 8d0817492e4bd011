"""Verifier: the lossless acceptance rule, applied to the target model's logits at a
speculating request's K + 1 verify rows (row j: after the last committed token and the
first j drafts).

Greedy: accept drafts while they equal the target's argmax, then emit the argmax at the
first mismatch (the bonus token when all were accepted). Sampling, the standard rejection
rule: accept draft t, drawn from q, with probability min(1, p(t) / q(t)); on rejection draw
from max(0, p - q) renormalized; the bonus token is drawn from p. A deterministic draft
(NGRAM) has q one-hot on t: accept with probability p(t), else draw from p without t.
p is the distribution plain sampling draws from at that step (same penalties, min-tokens
mask, temperature and filters: sampling/sampler.py), and every draw uses the request's
seed and the step's index, so speculative outputs are reproducible. A constrained
request's rows are masked by its grammar advanced over the drafts before each row
(sampling/grammar.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.engine.request import Req
from radixserve.sampling.grammar import GrammarBackend
from radixserve.sampling.noise import gumbel_from_uniform, uniform_noise
from radixserve.sampling.sampler import (
    SamplingBatch,
    apply_min_tokens,
    apply_penalties,
    is_plain_argmax,
    scale_and_filter,
)

NO_DRAFT = -1  # the draft column of a request's last (bonus) row


@dataclass(frozen=True)
class Verified:
    """One request's outcome: the accepted drafts, then the target's own token."""

    tokens: list[int]
    num_accepted: int
    path: list[int] | None = None  # a tree's accepted nodes, root to leaf; None: a chain


class Verifier:
    def __init__(
        self,
        min_tokens_stop_ids: Callable[[Req], list[int]],
        grammar: Callable[[], GrammarBackend] | None = None,
    ):
        self.min_tokens_stop_ids = min_tokens_stop_ids
        self.grammar = grammar  # built lazily by the scheduler, as for TokenSampler

    def verify(
        self,
        reqs: list[Req],
        drafts: list[list[int]],
        logits: torch.Tensor,
        probs: list[torch.Tensor | None] | None = None,
        parents: list[list[int] | None] | None = None,
    ) -> list[Verified]:
        """logits: [sum(len(d) + 1 for d in drafts), vocab], the requests' rows in order;
        probs: per request, the q its draft was drawn from ([len(d), vocab]; None: one-hot);
        parents: per request, its draft tree's (Draft.parents; None: a chain)."""
        if parents is not None and any(p is not None for p in parents):
            return self._verify_mixed(reqs, drafts, logits, probs, parents)
        columns = [t for draft in drafts for t in (*draft, NO_DRAFT)]
        draft_col = torch.tensor(columns, dtype=torch.int64, device=logits.device)
        if any(r.grammar is not None for r in reqs):
            logits = self._mask_grammar(reqs, drafts, logits.clone())  # callers keep theirs
        if all(is_plain_argmax(r.params, len(r.output_ids)) for r in reqs):
            target = logits.float().argmax(dim=-1)
            accepted = target == draft_col
        else:
            batch = self._batch(reqs, drafts, logits.shape[-1], logits.device)
            q = draft_rows(drafts, probs, logits.shape[-1], logits.device)
            accepted, target = accept_or_replace(logits, batch, draft_col, q)
        return _first_rejections(drafts, accepted.tolist(), target.tolist())

    def _verify_mixed(self, reqs, drafts, logits, probs, parents) -> list[Verified]:
        """Trees (tree_verify.py) and chains of one batch, each through its own rule."""
        from radixserve.engine.speculative.tree_verify import verify_trees

        starts = [0, *itertools.accumulate(len(d) + 1 for d in drafts)]
        trees = [i for i, p in enumerate(parents) if p is not None]
        chains = [i for i, p in enumerate(parents) if p is None]
        results: list[Verified | None] = [None] * len(reqs)
        for group, tree in ((trees, True), (chains, False)):
            if not group:
                continue
            rows = torch.cat([logits[starts[i] : starts[i + 1]] for i in group])
            sub_reqs, sub_drafts = [reqs[i] for i in group], [drafts[i] for i in group]
            if tree:
                if any(r.grammar is not None for r in sub_reqs):
                    rows = self._mask_tree_grammar(sub_reqs, sub_drafts,
                                                   [parents[i] for i in group], rows)  # fmt: skip
                sub = verify_trees(sub_reqs, sub_drafts, [parents[i] for i in group], rows,
                                   self.min_tokens_stop_ids)  # fmt: skip
            else:
                sub_probs = None if probs is None else [probs[i] for i in group]
                sub = self.verify(sub_reqs, sub_drafts, rows, sub_probs)
            for i, result in zip(group, sub):
                results[i] = result
        return results

    def _mask_tree_grammar(self, reqs, drafts, parents, logits: torch.Tensor) -> torch.Tensor:
        """Each constrained request's node rows masked by its grammar advanced over the
        node's path (every root-to-leaf path once; shared nodes mask the same)."""
        start = 0
        for req, tokens, req_parents in zip(reqs, drafts, parents):
            if req.grammar is not None:
                nodes: list[list[int]] = [[0]]  # each node's rows from the root
                for j, parent in enumerate(req_parents, start=1):
                    nodes.append(nodes[parent] + [j])
                leaves = set(range(len(nodes))) - set(req_parents)
                for leaf in sorted(leaves):
                    index = torch.tensor(nodes[leaf], device=logits.device) + start
                    rows = logits[index]
                    path = [tokens[j - 1] for j in nodes[leaf][1:]]
                    self.grammar().mask_draft_rows(rows, req.grammar, path)
                    logits[index] = rows
            start += len(tokens) + 1
        return logits

    def _mask_grammar(
        self, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor
    ) -> torch.Tensor:
        """Each constrained request's rows masked by its grammar after the drafts before."""
        start = 0
        for req, draft in zip(reqs, drafts):
            if req.grammar is not None:
                rows = logits[start : start + len(draft) + 1]  # a view: masked in place
                self.grammar().mask_draft_rows(rows, req.grammar, draft)
            start += len(draft) + 1
        return logits

    def _batch(
        self, reqs: list[Req], drafts: list[list[int]], vocab_size: int, device: torch.device
    ) -> SamplingBatch:
        """One sampling row per verify row: row j sees the output extended by j drafts."""
        rows = [
            (req, req.output_ids + draft[:j], self.min_tokens_stop_ids(req))
            for req, draft in zip(reqs, drafts)
            for j in range(len(draft) + 1)
        ]
        return SamplingBatch.build(
            [req.params for req, _, _ in rows],
            [req.seed for req, _, _ in rows],
            [output for _, output, _ in rows],
            [req.input_ids for req, _, _ in rows],
            [stop_ids for _, _, stop_ids in rows],
            vocab_size,
            device,
        )


def draft_rows(
    drafts: list[list[int]],
    probs: list[torch.Tensor | None] | None,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """q at every verify row [R, V] (one-hot on deterministic drafts, zeros on bonus rows);
    None when every draft is deterministic."""
    if probs is None or all(p is None for p in probs):
        return None
    rows = []
    for draft, q in zip(drafts, probs):
        if q is None:
            q = torch.nn.functional.one_hot(torch.tensor(draft, device=device), vocab_size)
        rows += [
            q.to(device=device, dtype=torch.float32),
            torch.zeros(1, vocab_size, device=device),
        ]
    return torch.cat(rows)


def accept_or_replace(
    logits: torch.Tensor,
    batch: SamplingBatch,
    drafts: torch.Tensor,
    q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `logits` [R, V]: whether its draft (`drafts` [R], NO_DRAFT on bonus rows)
    is accepted, and the token emitted there if it is not. Both [R]. q [R, V]: the draft
    distribution of each row (None: one-hot on the draft)."""
    logits = apply_min_tokens(apply_penalties(logits.float(), batch), batch)
    target = logits.argmax(dim=-1)
    accepted = target == drafts
    if batch.all_greedy:
        return accepted, target
    rows = batch.sample_rows
    if rows is None:
        rows = torch.arange(logits.shape[0], device=logits.device)
    if q is None:
        ok, replaced = _accept_sampled(logits[rows], batch, rows, drafts[rows])
    else:
        ok, replaced = _accept_sampled_q(logits[rows], batch, rows, drafts[rows], q[rows])
    return accepted.index_copy(0, rows, ok), target.index_copy(0, rows, replaced)


def _accept_sampled(
    logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor, drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule for a one-hot draft: u < p(t) accepts t (u: the step's uniform
    noise at column t); otherwise a Gumbel-max draw over the other columns, whose noise is
    independent of u. A bonus row draws from p exactly as plain sampling does."""
    filtered = scale_and_filter(logits, batch, rows)  # [R, V]
    uniform = uniform_noise(batch.seeds[rows], batch.steps[rows], batch.vocab_size)
    has_draft = drafts != NO_DRAFT
    col = drafts.clamp(min=0)[:, None]  # [R, 1]
    p_draft = filtered.softmax(dim=-1).gather(1, col)[:, 0]
    accepted = has_draft & (uniform.gather(1, col)[:, 0] < p_draft)
    without = filtered.scatter(1, col, float("-inf"))
    filtered = torch.where(has_draft[:, None], without, filtered)
    return accepted, (filtered + gumbel_from_uniform(uniform)).argmax(dim=-1)


def _accept_sampled_q(
    logits: torch.Tensor,
    batch: SamplingBatch,
    rows: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The general rejection rule: u * q(t) < p(t) accepts t; otherwise a Gumbel-max draw
    from max(0, p - q). A rejection means p(t) < q(t), so t is outside that residual and the
    draw never reads u's column. A bonus row draws from p as plain sampling does."""
    filtered = scale_and_filter(logits, batch, rows)  # [R, V]
    uniform = uniform_noise(batch.seeds[rows], batch.steps[rows], batch.vocab_size)
    has_draft = drafts != NO_DRAFT
    col = drafts.clamp(min=0)[:, None]  # [R, 1]
    p = filtered.softmax(dim=-1)
    q_draft = q.gather(1, col)[:, 0]
    accepted = has_draft & (uniform.gather(1, col)[:, 0] * q_draft < p.gather(1, col)[:, 0])
    residual = (p - q).clamp(min=0)
    # p == q leaves no residual; a rejection cannot happen there (u < 1), so any draw is moot
    use_residual = has_draft & (residual.sum(dim=-1) > 0)
    log_residual = torch.where(residual > 0, residual.log(), float("-inf"))
    scores = torch.where(use_residual[:, None], log_residual, filtered)
    return accepted, (scores + gumbel_from_uniform(uniform)).argmax(dim=-1)


def _first_rejections(
    drafts: list[list[int]], accepted: list[bool], target: list[int]
) -> list[Verified]:
    results, start = [], 0
    for draft in drafts:
        num = 0
        while num < len(draft) and accepted[start + num]:
            num += 1
        results.append(Verified(draft[:num] + [target[start + num]], num))
        start += len(draft) + 1
    return results
