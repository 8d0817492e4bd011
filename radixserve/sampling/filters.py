"""Top-k, top-p and min-p: which tokens a sampled row may draw, and the draw over them.

The exact rule (`sorted_filter`) sorts the whole vocabulary: ~4 ms a row at 49k tokens on
one CPU core, more than a small model's decode step. Most sampled requests keep a few
tokens (top_k 20-50, top_p 0.9-0.95 of a peaked distribution), so each row's largest
logits are looked at first (CANDIDATES: 256, then 4096): a row whose filters drop every
token beyond them (top_k within them, or the nucleus complete or min_p failed within them,
and no tie at their edge) is filtered there, and its draw hashes noise at those tokens only
(`noise.uniform_noise_at`, the same values); the other rows take the full sort. The kept
tokens are the same either way: ties order by index, as the stable sort does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from radixserve.sampling.noise import gumbel_from_uniform, uniform_noise_at

CANDIDATES = (256, 4096)
"""How many largest logits per row the fast path looks at: the first size, then for the
rows it does not cover the second (topk of 4096 of 49k: ~0.7 ms against the sort's ~4.5)."""


@dataclass(frozen=True)
class Filters:
    """Each row's top_k (the vocabulary's size: none), top_p and min_p, and which of the
    three any row uses."""

    top_ks: torch.Tensor  # [R] int64
    top_ps: torch.Tensor  # [R] float32
    min_ps: torch.Tensor  # [R] float32
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True

    def of_rows(self, rows: torch.Tensor) -> Filters:
        return replace(self, top_ks=self.top_ks[rows], top_ps=self.top_ps[rows],
                       min_ps=self.min_ps[rows])  # fmt: skip


class Candidates(NamedTuple):
    logits: torch.Tensor  # [R, n] filtered (-inf: removed), largest first
    ids: torch.Tensor  # [R, n] their vocab indices
    covered: torch.Tensor  # [R] bool: the filters remove every token beyond them


def filter_logits(logits: torch.Tensor, filters: Filters) -> torch.Tensor:
    """Sets tokens outside top-k, then top-p (renormalized), then min-p to -inf. [R, V]."""
    found, rest = covered_rows(logits, filters)
    out = torch.full_like(logits, float("-inf"))
    for rows, kept in found:
        out[rows] = torch.full_like(logits[rows], float("-inf")).scatter_(1, kept.ids, kept.logits)
    if rest.numel():
        out[rest] = sorted_filter(logits[rest], filters.of_rows(rest))
    return out


def filtered_draw(
    logits: torch.Tensor, filters: Filters, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """A Gumbel-max draw per row of `logits` [R, V] (scaled) under its filters: the token
    argmax(filtered + noise) picks, computed over the candidates where they cover. [R]."""
    found, rest = covered_rows(logits, filters)
    tokens = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    for rows, kept in found:
        noise = gumbel_from_uniform(uniform_noise_at(seeds[rows], steps[rows], kept.ids))
        pick = (kept.logits + noise).max(dim=-1).indices
        tokens[rows] = kept.ids.gather(1, pick[:, None]).squeeze(1)
    if rest.numel():
        filtered = sorted_filter(logits[rest], filters.of_rows(rest))
        vocab = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        noise = gumbel_from_uniform(uniform_noise_at(seeds[rest], steps[rest], vocab))
        tokens[rest] = (filtered + noise).max(dim=-1).indices
    return tokens


def covered_rows(
    logits: torch.Tensor, filters: Filters
) -> tuple[list[tuple[torch.Tensor, Candidates]], torch.Tensor]:
    """(rows, their candidates) for each size in CANDIDATES that covers rows the smaller did
    not, and the rows none covers (a vocabulary not much larger than a size: all of them)."""
    rest = torch.arange(len(logits), device=logits.device)
    found = []
    for num in CANDIDATES:
        if not rest.numel() or logits.shape[-1] <= 2 * num:
            break
        kept = candidates(logits[rest], filters.of_rows(rest), num)
        hit = kept.covered
        if hit.any():
            found.append((rest[hit], Candidates(kept.logits[hit], kept.ids[hit], hit[hit])))
        rest = rest[~hit]
    return found, rest


def candidates(logits: torch.Tensor, filters: Filters, num: int) -> Candidates:
    """Each row's `num` largest logits, filtered, and whether they hold every token the
    filters keep."""
    top_ks, top_ps, min_ps = filters.top_ks, filters.top_ps, filters.min_ps
    values, ids = logits.topk(num + 1, dim=-1)
    by_id = ids.argsort(dim=-1)  # ties in index order, as the stable sort puts them
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    top, outside = values[:, :num], values[:, num]
    covered = top[:, -1] > outside  # no tie at the edge
    remove = torch.zeros_like(top, dtype=torch.bool)
    beyond = torch.zeros_like(covered)  # the filters remove the tokens past the candidates
    within_k = (top_ks <= num) & filters.use_top_k
    if filters.use_top_k:
        remove |= torch.arange(num, device=logits.device)[None, :] >= top_ks[:, None]
        beyond |= within_k
    if filters.use_top_p or filters.use_min_p:
        # a top_k past the candidates (not the whole vocabulary) normalizes over tokens
        # not looked at: those rows take the sort
        covered &= within_k | (top_ks >= logits.shape[-1])
        kept_lse = top.masked_fill(remove, float("-inf")).logsumexp(dim=-1)
        lse = torch.where(within_k, kept_lse, logits.logsumexp(dim=-1))
        probs = (top - lse[:, None]).exp().masked_fill(remove, 0.0)
        if filters.use_top_p:
            mass_before = probs.cumsum(dim=-1) - probs
            remove |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1)
            beyond |= (probs.sum(dim=-1) >= top_ps) & (top_ps < 1)
        if filters.use_min_p:
            remove |= probs < min_ps[:, None] * probs[:, :1]
            beyond |= (outside - lse).exp() < min_ps * probs[:, 0]
    return Candidates(top.masked_fill(remove, float("-inf")), ids[:, :num], covered & beyond)


def sorted_filter(logits: torch.Tensor, filters: Filters) -> torch.Tensor:
    """The exact rule over the whole sorted vocabulary. [R, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if filters.use_top_k:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        remove |= ranks[None, :] >= filters.top_ks[:, None]
    if filters.use_top_p or filters.use_min_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        if filters.use_top_p:
            mass_before = probs.cumsum(dim=-1) - probs  # the top token always has 0 before it
            top_ps = filters.top_ps[:, None]
            remove |= (mass_before >= top_ps) & (top_ps < 1)
        if filters.use_min_p:
            remove |= probs < filters.min_ps[:, None] * probs[:, :1]
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, filtered)
