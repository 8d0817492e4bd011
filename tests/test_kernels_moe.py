"""The fused-MoE Triton kernel (radixserve_kernels.fused_moe) against its torch reference on
CPU under TRITON_INTERPRET=1: routed rows sorted by expert into padded blocks, experts that
got no row, expert parallelism's local slice (other ranks' experts add nothing); and the
model's own grouped path (model/moe.py) gives the reference too. Tiny shapes, few cases:
the interpreter is slow."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit of ours runs

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixserve.model.moe import grouped_experts, route  # noqa: E402
from radixserve_kernels.fused_moe import align_by_expert, fused_moe  # noqa: E402
from radixserve_kernels.reference import fused_moe_ref  # noqa: E402


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    routing = route(torch.randn(tokens, experts, generator=gen), top_k, norm_topk_prob=True)
    return x, w13, w2, routing


def test_align_by_expert_pads_each_experts_run_to_whole_blocks():
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])  # assignments 0..5; expert 1: none
    sorted_ids, block_expert = align_by_expert(experts, num_local=4, block_m=4)
    sentinel = experts.numel()
    assert sorted_ids.shape[0] == 20  # 6 + 4 * 3 rounded up to whole blocks
    assert sorted_ids[:8].tolist() == [1, 4, sentinel, sentinel, 0, 2, 5, sentinel]
    assert sorted_ids[8:12].tolist() == [3, sentinel, sentinel, sentinel]
    assert block_expert.tolist() == [0, 2, 3, -1, -1]
    _, upper = align_by_expert(experts, num_local=2, first_expert=2, block_m=4)
    assert upper.tolist()[:2] == [0, 1] and set(upper.tolist()[2:]) == {-1}


@pytest.mark.parametrize("tokens, experts, top_k", [(5, 4, 2), (9, 6, 3)])
def test_fused_moe_matches_reference(tokens, experts, top_k):
    x, w13, w2, routing = _case(tokens, experts, top_k, hidden=32, inter=24, seed=tokens)
    want = fused_moe_ref(x, w13, w2, routing.weights, routing.experts)
    got = fused_moe(x, w13, w2, routing.weights, routing.experts)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grouped_experts(x, w13, w2, routing), want, atol=1e-4, rtol=1e-4)
    half = experts // 2  # expert parallelism: the upper half's rank
    local = fused_moe(x, w13[half:], w2[half:], routing.weights, routing.experts, half)
    want_local = fused_moe_ref(x, w13[half:], w2[half:], routing.weights, routing.experts, half)
    torch.testing.assert_close(local, want_local, atol=1e-4, rtol=1e-4)
