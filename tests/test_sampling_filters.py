"""The filters' candidate fast path (sampling/filters.py) against the exact sorted rule: the
same kept tokens and the same draws, peaked and flat rows, ties at the candidates' edge."""

from __future__ import annotations

import itertools

import pytest
import torch

from radixserve.sampling.filters import (
    CANDIDATES,
    Filters,
    covered_rows,
    filter_logits,
    filtered_draw,
    sorted_filter,
)
from radixserve.sampling.noise import gumbel_noise

V = 16384  # past 2 x each of CANDIDATES: both sizes run


def rows_and_params():
    """Peaked, medium and flat rows under every mix of top-k, top-p and min-p."""
    generator = torch.Generator().manual_seed(0)
    scales = [12.0, 4.0, 1.5, 0.3]
    small, large = CANDIDATES
    top_ks = [1, 7, small, small + 1, large, large + 1, V]
    top_ps, min_ps = [0.3, 0.9, 0.99, 1.0], [0.0, 0.05]
    combos = list(itertools.product(scales, top_ks, top_ps, min_ps))
    logits = torch.stack([torch.randn(V, generator=generator) * s for s, *_ in combos])
    logits[0, :] = 0.0  # all tied
    for row, num in ((1, small), (2, large)):  # ties at each size's edge
        logits[row, :5] = logits[row].sort(descending=True).values[num - 1]
    ks = torch.tensor([k for _, k, _, _ in combos])
    ps = torch.tensor([p for _, _, p, _ in combos])
    mins = torch.tensor([m for _, _, _, m in combos])
    return logits, ks, ps, mins


def test_the_candidate_path_keeps_what_the_sort_keeps():
    """The same kept tokens, but for a token whose top-p mass lies within float32's rounding
    of p (the two paths sum the probabilities in different orders)."""
    logits, ks, ps, mins = rows_and_params()
    for flags in itertools.product([False, True], repeat=3):
        if not any(flags):
            continue
        filters = Filters(ks, ps, mins, *flags)
        fast, exact = filter_logits(logits, filters), sorted_filter(logits, filters)
        differ = torch.isfinite(fast) != torch.isfinite(exact)
        for row, token in differ.nonzero().tolist():
            top_k = int(ks[row]) if flags[0] else V
            assert on_the_top_p_edge(logits[row], token, top_k, float(ps[row])), (flags, row)
        both = torch.isfinite(fast) & torch.isfinite(exact)
        assert torch.equal(fast[both], exact[both])


def on_the_top_p_edge(row: torch.Tensor, token: int, top_k: int, top_p: float) -> bool:
    """Whether the mass before `token` among the row's top_k (float64) is within 1e-5 of
    top_p."""
    order = row.sort(descending=True, stable=True).indices[:top_k]
    probs = row[order].double().softmax(dim=-1)
    rank = (order == token).nonzero()
    return rank.numel() == 1 and abs(float(probs[: int(rank)].sum()) - top_p) < 1e-5


def test_draws_equal_the_full_vocabulary_draw():
    logits, ks, ps, mins = rows_and_params()
    filters = Filters(ks, ps, mins)
    seeds = torch.arange(len(logits)) * 7919
    same = (torch.isfinite(filter_logits(logits, filters))
            == torch.isfinite(sorted_filter(logits, filters))).all(dim=-1)  # fmt: skip
    assert same.float().mean() > 0.95
    for step in range(3):
        steps = torch.full((len(logits),), step)
        fast = filtered_draw(logits, filters, seeds, steps)
        exact = sorted_filter(logits, filters) + gumbel_noise(seeds, steps, V)
        assert torch.equal(fast[same], exact.max(dim=-1).indices[same])


def test_each_size_covers_some_rows_and_the_sort_takes_the_rest():
    logits, ks, ps, mins = rows_and_params()
    found, rest = covered_rows(logits, Filters(ks, ps, mins))
    assert len(found) == 2 and rest.numel() > 0
    rows = torch.cat([rest, *(r for r, _ in found)])
    assert sorted(rows.tolist()) == list(range(len(logits)))


def test_the_cpp_noise_is_the_torch_noise_bit_for_bit():
    """csrc/seeded_noise.cpp (used once the kernels are loaded) against noise.py's torch
    ops: seeds of every sign, late steps, ids per row and shared by all rows."""
    from radixserve.native.extension import CpuExtensionUnavailable, load_cpu_ops
    from radixserve.sampling.noise import hashed_uniform, row_keys

    try:
        ops = load_cpu_ops()
    except CpuExtensionUnavailable as exc:
        pytest.skip(str(exc))
    seeds = torch.tensor([0, 1, -1, 2**62, -(2**63), 123456789])
    steps = torch.tensor([0, 5, 1000, 7, 2**40, 3])
    keys = row_keys(seeds, steps)
    per_row = torch.randint(0, 2**31, (6, 300), generator=torch.Generator().manual_seed(1))
    shared = torch.arange(V)[None, :]
    for ids in (per_row, shared):
        assert torch.equal(ops.uniform_noise_at(keys, ids), hashed_uniform(keys, ids))
