"""Triton kernels against their torch references, on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit of ours runs

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixserve_kernels.kv_store import store_kv  # noqa: E402
from radixserve_kernels.paged_decode import paged_decode_attention  # noqa: E402
from radixserve_kernels.paged_extend import paged_extend_attention  # noqa: E402
from radixserve_kernels.reference import (  # noqa: E402
    paged_decode_attention_ref,
    paged_extend_attention_ref,
    store_kv_ref,
)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


def _paged_inputs(seq_lens, page_size, heads=4, kv_heads=2, dim=24, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + 3
    perm = torch.randperm(num_pages - 1, generator=gen) + 1  # scattered, never page 0
    table = torch.zeros(len(seq_lens), max(pages_per_req), dtype=torch.int64)
    start = 0
    for i, n in enumerate(pages_per_req):
        table[i, :n] = perm[start : start + n]
        start += n
    shape = (num_pages * page_size, kv_heads, dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen).to(dtype)
    return q, k, v, table, torch.tensor(seq_lens)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_decode_matches_reference(page_size, dtype):
    lens = [1, 7, 40, 129]  # ragged; 129 spans several splits of 32
    q, k, v, table, seq_lens = _paged_inputs(lens, page_size, dtype=dtype)
    got = paged_decode_attention(q, k, v, table, seq_lens, page_size, split_len=32, block_n=16)
    want = paged_decode_attention_ref(q, k, v, table, seq_lens, page_size)
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


def test_paged_decode_split_count_does_not_change_the_result():
    q, k, v, table, seq_lens = _paged_inputs([50, 300], 16)
    one = paged_decode_attention(q, k, v, table, seq_lens, 16, split_len=4096)
    many = paged_decode_attention(q, k, v, table, seq_lens, 16, split_len=16)
    torch.testing.assert_close(one, many, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(5, 3, 20, generator=gen).to(dtype)
    v = torch.randn(5, 3, 20, generator=gen).to(dtype)
    slots = torch.tensor([9, 2, 31, 0, 17])
    caches = [torch.zeros(32, 3, 20, dtype=dtype) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots, block=16)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_extend_matches_reference(page_size, dtype, window):
    prefix_lens, extend_lens = [0, 13, 40, 3], [9, 1, 20, 33]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    _, k, v, table, _ = _paged_inputs(seq_lens, page_size, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(extend_lens), 4, 24, generator=gen).to(dtype)
    starts = torch.tensor([0, 9, 10, 30])
    got = paged_extend_attention(
        q, k, v, table, starts, torch.tensor(prefix_lens), torch.tensor(extend_lens),
        max(extend_lens), page_size, sliding_window=window,
    )  # fmt: skip
    want = paged_extend_attention_ref(
        q, k, v, table, prefix_lens, extend_lens, page_size, sliding_window=window
    )
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


def test_paged_extend_with_draft_trees_matches_reference():
    """A chain beside two draft trees (one after plain tokens), under a window that cuts
    along the trees' paths: each node sees its prefix and its ancestors at prefix + depth."""
    from radixserve.forward_batch import tree_ancestors
    from radixserve_kernels.paged_extend import TreeMasks

    prefix_lens, extend_lens = [13, 40, 21], [3, 9, 7]
    masks = {
        1: torch.ones(9, 9, dtype=torch.bool).tril(),
        2: torch.from_numpy(tree_ancestors([0, 0, 1, 2, 2, 4])),
    }
    masks[1][2:, 2:] = torch.from_numpy(tree_ancestors([0, 0, 1, 1, 3, 0]))
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    _, k, v, table, _ = _paged_inputs(seq_lens, 16)
    q = torch.randn(sum(extend_lens), 4, 24, generator=torch.Generator().manual_seed(3))
    trees = TreeMasks.build(masks, extend_lens, q.device)
    got = paged_extend_attention(
        q, k, v, table, torch.tensor([0, 3, 12]), torch.tensor(prefix_lens),
        torch.tensor(extend_lens), max(extend_lens), 16, sliding_window=20, trees=trees,
    )  # fmt: skip
    want = paged_extend_attention_ref(
        q, k, v, table, prefix_lens, extend_lens, 16, sliding_window=20, tree_masks=masks
    )
    torch.testing.assert_close(got, want, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_soft_capped_decode_and_extend_match_reference(dtype):
    """Scores soft-capped (Gemma's attn_logit_softcapping) at 1.5, with queries large enough
    that the cap changes the output, in both kernels and a window in the extend."""
    q, k, v, table, seq_lens = _paged_inputs([1, 7, 40, 129], 16, dtype=dtype)
    q = (q.float() * 4).to(dtype)
    got = paged_decode_attention(q, k, v, table, seq_lens, 16, split_len=32, logit_cap=1.5)
    want = paged_decode_attention_ref(q, k, v, table, seq_lens, 16, logit_cap=1.5)
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)
    plain = paged_decode_attention_ref(q, k, v, table, seq_lens, 16)
    assert (plain.float() - want.float()).abs().max() > 0.1
    prefix_lens, extend_lens = [0, 13, 40], [9, 1, 20]
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    _, k, v, table, _ = _paged_inputs(seq, 16, dtype=dtype)
    q = (torch.randn(30, 4, 24, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    got = paged_extend_attention(
        q, k, v, table, torch.tensor([0, 9, 10]), torch.tensor(prefix_lens),
        torch.tensor(extend_lens), 20, 16, sliding_window=5, logit_cap=1.5,
    )  # fmt: skip
    want = paged_extend_attention_ref(
        q, k, v, table, prefix_lens, extend_lens, 16, sliding_window=5, logit_cap=1.5
    )
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)
