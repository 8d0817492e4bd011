"""Verifying draft trees (EAGLE3 with --speculative-eagle-topk > 1): the target's logits at
every node of a request's tree (node 0: its last token) pick the longest path it accepts.

    greedy     from the root, follow the child whose token is the target's argmax at the
               node; where none is, the argmax is the target's own token
    sampling   tree rejection sampling (EAGLE / SGLang): the drafts are deterministic (q
               one-hot), so at a node each child t is tried in order and accepted with
               probability p'(t), p' being p with the children rejected before removed and
               renormalised; after the last rejection the target's token is drawn from p'
               (a leaf's bonus token from p) - the emitted token is distributed as p

The draws use the step's uniform noise as the chain's rule does (verifier.py): a child's
test reads u at its own column and the residual draw only the columns not yet tested, so
they are independent, and a node at depth d draws with the step of output token len + d.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.engine.request import Req
from radixserve.engine.speculative.verifier import Verified
from radixserve.sampling.noise import gumbel_from_uniform, uniform_noise
from radixserve.sampling.sampler import (
    SamplingBatch,
    apply_min_tokens,
    apply_penalties,
    scale_and_filter,
)


def children_of(parents: list[int]) -> list[list[int]]:
    """Each node's children (node indices, in order), node 0 the root."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, parent in enumerate(parents, start=1):
        kids[parent].append(j)
    return kids


def path_tokens(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's drafts from the root to it (the root's: [])."""
    paths: list[list[int]] = [[]]
    for token, parent in zip(tokens, parents):
        paths.append(paths[parent] + [token])
    return paths


def verify_trees(
    reqs: list[Req],
    tokens: list[list[int]],
    parents: list[list[int]],
    logits: torch.Tensor,
    min_tokens_stop_ids: Callable[[Req], list[int]],
) -> list[Verified]:
    """logits: [sum(len(t) + 1 for t in tokens), vocab], each request's node rows in order.
    Returns each request's accepted drafts plus the target's token, with the path's nodes."""
    paths = [path_tokens(t, p) for t, p in zip(tokens, parents)]
    rows = [(req, path) for req, req_paths in zip(reqs, paths) for path in req_paths]
    batch = SamplingBatch.build(
        [req.params for req, _ in rows],
        [req.seed for req, _ in rows],
        [req.output_ids + path for req, path in rows],
        [req.input_ids for req, _ in rows],
        [min_tokens_stop_ids(req) for req, _ in rows],
        logits.shape[-1],
        logits.device,
    )
    logits = apply_min_tokens(apply_penalties(logits.float(), batch), batch)
    greedy = logits.argmax(dim=-1).tolist()
    sampled = _SampledRows.build(logits, batch)
    results, start = [], 0
    for req_tokens, req_parents in zip(tokens, parents):
        kids = children_of(req_parents)
        walk = _walk_sampled if sampled.has(start) else _walk_greedy
        results.append(walk(req_tokens, kids, start, greedy, sampled))
        start += len(req_tokens) + 1
    return results


class _SampledRows:
    """The sampling rows' filtered logits [S, V], probabilities and uniform noise."""

    def __init__(self, rows: list[int], filtered, probs, uniform):
        self.index = {row: i for i, row in enumerate(rows)}
        self.filtered, self.probs, self.uniform = filtered, probs, uniform

    @classmethod
    def build(cls, logits: torch.Tensor, batch: SamplingBatch) -> _SampledRows:
        if batch.all_greedy:
            return cls([], None, None, None)
        rows = batch.sample_rows
        if rows is None:
            rows = torch.arange(logits.shape[0], device=logits.device)
        filtered = scale_and_filter(logits[rows], batch, rows)
        uniform = uniform_noise(batch.seeds[rows], batch.steps[rows], batch.vocab_size)
        return cls(rows.tolist(), filtered, filtered.softmax(dim=-1), uniform)

    def has(self, row: int) -> bool:
        return row in self.index

    def draw(self, row: int, rejected: list[int]) -> int:
        """A Gumbel-max draw at `row` from p without the `rejected` columns (plain
        sampling's draw when there are none)."""
        i = self.index[row]
        scores = self.filtered[i].clone()
        if rejected:
            scores[torch.tensor(rejected, device=scores.device)] = float("-inf")
        return int((scores + gumbel_from_uniform(self.uniform[i])).argmax())


def _walk_greedy(
    tokens: list[int], kids: list[list[int]], start: int, greedy: list[int], sampled
) -> Verified:
    node, path = 0, []
    while True:
        target = greedy[start + node]
        child = next((c for c in kids[node] if tokens[c - 1] == target), None)
        if child is None:
            return Verified([tokens[c - 1] for c in path] + [target], len(path), path)
        node = child
        path.append(child)


def _walk_sampled(
    tokens: list[int], kids: list[list[int]], start: int, greedy, sampled: _SampledRows
) -> Verified:
    node, path = 0, []
    while True:
        row = sampled.index[start + node]
        child_tokens = [tokens[c - 1] for c in kids[node]]
        accepted, rejected = None, []
        if child_tokens:
            cols = torch.tensor(child_tokens, device=sampled.probs.device)
            p = sampled.probs[row, cols].tolist()
            u = sampled.uniform[row, cols].tolist()
            mass = 1.0
            for c, token, p_t, u_t in zip(kids[node], child_tokens, p, u):
                if mass > 0 and u_t * mass < p_t:  # u < p'(t) = p(t) / mass
                    accepted = c
                    break
                rejected.append(token)
                mass -= p_t
        if accepted is None:
            target = sampled.draw(start + node, rejected)
            return Verified([tokens[c - 1] for c in path] + [target], len(path), path)
        node = accepted
        path.append(accepted)
