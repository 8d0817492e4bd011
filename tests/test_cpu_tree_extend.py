"""cpu_fused's draft-tree verification (EAGLE3 with --speculative-eagle-topk > 1): the C++
paged_extend with `tree_parents` against torch_native's masked SDPA, each tree row bitwise
the row of its root-to-node path run as a plain sequence (what lets tree drafting run under
--enable-deterministic-inference), and bad parents refused."""

from __future__ import annotations

import pytest
import torch
from test_cpu_paged_decode import FP32_TOL, _attend, _page_tables, _pool

from radixserve.attention.cpu_fused import CpuFusedBackend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.forward_batch import ForwardBatch, tree_depths

# (prefix, new tokens before the tree's root, the tree's parents; None: a plain extend):
# a chain, a tree after two plain tokens, a decode, a tree across a 64-key block boundary,
# a tree over an almost empty prefix.
REQUESTS = [
    (70, 5, None),
    (100, 2, [0, 0, 1, 1, 2, 2, 3, 5, 5]),
    (40, 1, None),
    (58, 0, [0, 1, 2, 0, 4, 1, 6, 3, 3, 8, 2, 10]),
    (3, 1, [0, 0, 0, 2, 4]),
]


@pytest.fixture(scope="module")
def ops(cpu_ops):
    return cpu_ops


def _tree_batch(pool, heads: int, seed: int = 0):
    """REQUESTS as one batch (pages shuffled), with random q, k, v for its new tokens."""
    size = pool.shape.page_size
    new = [before + 1 + len(p) if p else before for _, before, p in REQUESTS]
    prefix = [p for p, _, _ in REQUESTS]
    tables = _page_tables([a + b for a, b in zip(prefix, new)], size, pool.shape.num_pages, seed, 0)
    batch = ForwardBatch.build(
        [[1] * n for n in new], prefix, tables, size, tree_parents=[p for _, _, p in REQUESTS]
    )
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch.num_tokens, heads, pool.shape.head_dim, generator=gen)
    kv_shape = (batch.num_tokens, pool.shape.num_kv_heads, pool.shape.head_dim)
    return batch, q, torch.randn(kv_shape, generator=gen), torch.randn(kv_shape, generator=gen)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (2, 8)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("deterministic", [False, True])
def test_tree_rows_match_torch_native(ops, page_size, kv_heads, group, window, deterministic):
    pool = _pool(page_size, kv_heads, 64, torch.float32)
    batch, q, k, v = _tree_batch(pool, kv_heads * group)
    expected = _attend(TorchNativeBackend(pool, sliding_window=window), batch, q, k, v)
    fused = CpuFusedBackend(pool, sliding_window=window, ops=ops, deterministic=deterministic)
    got = _attend(fused, batch, q, k, v)
    meta = batch.attn_metadata
    assert not meta.extends and meta.in_place.tree_parents is not None  # no SDPA left
    torch.testing.assert_close(got, expected, **FP32_TOL)


@pytest.mark.parametrize(
    "page_size,window,pool_dtype",
    [(16, None, torch.float32), (1, 24, torch.float32), (16, 24, torch.bfloat16)],
)
def test_tree_rows_are_bitwise_their_paths_as_sequences(ops, page_size, window, pool_dtype):
    """Under deterministic routing every tree node's row equals, bit for bit, a one-token
    extend of that node over the prefix followed by its ancestors at consecutive positions."""
    pool = _pool(page_size, 2, 64, pool_dtype)
    batch, q, k, v = _tree_batch(pool, 6)
    fused = CpuFusedBackend(pool, sliding_window=window, ops=ops, deterministic=True)
    tree_out = _attend(fused, batch, q, k, v)
    k_pool, v_pool = pool.layer_kv(0)
    slots, rows, chains = batch.out_slots, [], []
    used = {int(p) for t in batch.page_table.tolist() for p in t}
    free = iter(sorted(set(range(1, pool.shape.num_pages)) - used))
    start = 0
    for req, (prefix, before, parents) in enumerate(REQUESTS):
        num = before + 1 + len(parents) if parents else before
        if parents:
            nodes = list(range(before))  # the plain tokens, then the tree's paths
            depth_of = tree_depths(parents)
            for node in range(len(parents) + 1):
                path, at = [node], node
                while at:
                    at = parents[at - 1]
                    path.insert(0, at)
                assert len(path) == depth_of[node] + 1
                tokens = nodes + [before + n for n in path]
                rows.append(start + before + node)
                chains.append((req, prefix, [start + t for t in tokens]))
        start += num
    tables, q_rows = [], []
    for req, prefix, tokens in chains:
        length = prefix + len(tokens)
        table = [next(free) for _ in range(-(-length // page_size))]
        src_prefix = [
            int(batch.page_table[req, p // page_size]) * page_size + p % page_size
            for p in range(prefix)
        ]
        dst = [table[p // page_size] * page_size + p % page_size for p in range(length)]
        src = torch.tensor(src_prefix + [int(slots[t]) for t in tokens])
        k_pool[torch.tensor(dst)] = k_pool[src]
        v_pool[torch.tensor(dst)] = v_pool[src]
        tables.append(table)
        q_rows.append(tokens[-1])
    lens = [prefix + len(tokens) - 1 for _, prefix, tokens in chains]
    singles = ForwardBatch.build([[1]] * len(chains), lens, tables, page_size)
    fused.init_forward(singles)
    chain_q = q[torch.tensor(q_rows)]
    chain_out = fused.forward_stored(chain_q, None, None, 0, singles)
    assert torch.equal(tree_out[torch.tensor(rows)], chain_out)


def test_bad_tree_parents_are_refused(ops):
    pool = _pool(16, 1, 64, torch.float32)
    k_pool, v_pool = pool.layer_kv(0)
    q, one, t = torch.randn(4, 1, 64), torch.tensor([0]), torch.tensor

    def call(parents):
        return ops.paged_extend(q, k_pool, v_pool, t([[1, 2]]), one, t([20]), t([4]), one,
                                16, -1, 0.125, t(parents))  # fmt: skip

    with pytest.raises(RuntimeError, match="is not -1 .first token. or an earlier token"):
        call([-1, 0, 2, 1])
    with pytest.raises(RuntimeError, match="is not -1"):
        call([0, 0, 1, 1])
    with pytest.raises(RuntimeError, match="one entry per q row"):
        call([-1, 0, 1])
