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

from typing import NamedTuple

import torch

from radixserve.sampling.noise import gumbel_from_uniform, uniform_noise_at

CANDIDATES = (256, 4096)
"""How many largest logits per row the fast path looks at: the first size, then for the
rows it does not cover the second (topk of 4096 of 49k: ~0.7 ms against the sort's ~4.5)."""


class Candidates(NamedTuple):
    logits: torch.Tensor  # [R, n] filtered (-inf: removed), largest first
    ids: torch.Tensor  # [R, n] their vocab indices
    covered: torch.Tensor  # [R] bool: the filters remove every token beyond them


def filter_logits(
    logits: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    use_top_k: bool = True,
    use_top_p: bool = True,
    use_min_p: bool = True,
) -> torch.Tensor:
    """Sets tokens outside top-k, then top-p (renormalized), then min-p to -inf. [R, V]."""
    flags = (use_top_k, use_top_p, use_min_p)
    found, rest = covered_rows(logits, top_ks, top_ps, min_ps, flags)
    out = torch.full_like(logits, float("-inf"))
    for rows, kept in found:
        out[rows] = torch.full_like(logits[rows], float("-inf")).scatter_(1, kept.ids, kept.logits)
    if rest.numel():
        out[rest] = sorted_filter(logits[rest], top_ks[rest], top_ps[rest], min_ps[rest], *flags)
    return out


def filtered_draw(
    logits: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    flags: tuple[bool, bool, bool],
) -> torch.Tensor:
    """A Gumbel-max draw per row of `logits` [R, V] (scaled) under its filters: the token
    argmax(filtered + noise) picks, computed over the candidates where they cover. [R]."""
    found, rest = covered_rows(logits, top_ks, top_ps, min_ps, flags)
    tokens = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    for rows, kept in found:
        noise = gumbel_from_uniform(uniform_noise_at(seeds[rows], steps[rows], kept.ids))
        pick = (kept.logits + noise).max(dim=-1).indices
        tokens[rows] = kept.ids.gather(1, pick[:, None]).squeeze(1)
    if rest.numel():
        filtered = sorted_filter(logits[rest], top_ks[rest], top_ps[rest], min_ps[rest], *flags)
        vocab = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        noise = gumbel_from_uniform(uniform_noise_at(seeds[rest], steps[rest], vocab))
        tokens[rest] = (filtered + noise).max(dim=-1).indices
    return tokens


def covered_rows(
    logits: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    flags: tuple[bool, bool, bool],
) -> tuple[list[tuple[torch.Tensor, Candidates]], torch.Tensor]:
    """(rows, their candidates) for each size in CANDIDATES that covers rows the smaller did
    not, and the rows none covers (a vocabulary not much larger than a size: all of them)."""
    rest = torch.arange(len(logits), device=logits.device)
    found = []
    for num in CANDIDATES:
        if not rest.numel() or logits.shape[-1] <= 2 * num:
            break
        kept = candidates(logits[rest], top_ks[rest], top_ps[rest], min_ps[rest], *flags, num)
        hit = kept.covered
        if hit.any():
            found.append((rest[hit], Candidates(kept.logits[hit], kept.ids[hit], hit[hit])))
        rest = rest[~hit]
    return found, rest


def candidates(
    logits: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
    num: int,
) -> Candidates:
    """Each row's `num` largest logits, filtered, and whether they hold every token the
    filters keep."""
    values, ids = logits.topk(num + 1, dim=-1)
    by_id = ids.argsort(dim=-1)  # ties in index order, as the stable sort puts them
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    top, outside = values[:, :num], values[:, num]
    covered = top[:, -1] > outside  # no tie at the edge
    remove = torch.zeros_like(top, dtype=torch.bool)
    beyond = torch.zeros_like(covered)  # the filters remove the tokens past the candidates
    within_k = (top_ks <= num) & use_top_k
    if use_top_k:
        remove |= torch.arange(num, device=logits.device)[None, :] >= top_ks[:, None]
        beyond |= within_k
    if use_top_p or use_min_p:
        # a top_k past the candidates (not the whole vocabulary) normalizes over tokens
        # not looked at: those rows take the sort
        covered &= within_k | (top_ks >= logits.shape[-1])
        kept_lse = top.masked_fill(remove, float("-inf")).logsumexp(dim=-1)
        lse = torch.where(within_k, kept_lse, logits.logsumexp(dim=-1))
        probs = (top - lse[:, None]).exp().masked_fill(remove, 0.0)
        if use_top_p:
            mass_before = probs.cumsum(dim=-1) - probs
            remove |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1)
            beyond |= (probs.sum(dim=-1) >= top_ps) & (top_ps < 1)
        if use_min_p:
            remove |= probs < min_ps[:, None] * probs[:, :1]
            beyond |= (outside - lse).exp() < min_ps * probs[:, 0]
    return Candidates(top.masked_fill(remove, float("-inf")), ids[:, :num], covered & beyond)


def sorted_filter(
    logits: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    use_top_k: bool = True,
    use_top_p: bool = True,
    use_min_p: bool = True,
) -> torch.Tensor:
    """The exact rule over the whole sorted vocabulary. [R, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_top_k:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        remove |= ranks[None, :] >= top_ks[:, None]
    if use_top_p or use_min_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        if use_top_p:
            mass_before = probs.cumsum(dim=-1) - probs  # the top token always has 0 before it
            remove |= (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1)
        if use_min_p:
            remove |= probs < min_ps[:, None] * probs[:, :1]
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, filtered)
