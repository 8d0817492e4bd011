"""The flashinfer backend: clear errors where it cannot run, and the CSR page lists that its
`plan` reads, checked on hand-built ragged batches against our pool's slot layout. The kernels
themselves need CUDA (and flashinfer): that test runs on a GPU machine only."""

from __future__ import annotations

import importlib.util
import random
import sys

import pytest
import torch

from radixserve.attention import create_attention_backend, default_backend
from radixserve.attention.flashinfer_backend import (
    import_flashinfer,
    paged_kv_plan_inputs,
    tree_batch_mask,
    window_left,
)
from radixserve.cache.kv_pool import KVPool, PoolShape
from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.runner import ModelRunner

HAS_CUDA_FLASHINFER = torch.cuda.is_available() and importlib.util.find_spec("flashinfer")


def _cpu_pool() -> KVPool:
    return KVPool(PoolShape(2, 16, 4, 2, 8), torch.float32, "cpu")


def test_flashinfer_on_cpu_is_a_clear_error(tiny_models):
    pool = _cpu_pool()
    with pytest.raises(ValueError, match="attention_backend='flashinfer' runs on CUDA only"):
        create_attention_backend("flashinfer", pool, pool.device, num_heads=4)
    with pytest.raises(ValueError, match="attention_backend='flashinfer'"):
        ModelRunner.create(
            LoadConfig(model=str(tiny_models["llama"]), device="cpu"),
            CacheConfig(max_total_tokens=256, attention_backend="flashinfer"),
        )


def test_missing_flashinfer_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="attention_backend='flashinfer'.*flashinfer-python"):
        import_flashinfer()


def test_registry_and_auto_default():
    assert default_backend(torch.device("cpu")) == "cpu_fused"
    pool = _cpu_pool()
    # cpu_fused where its C++ kernel builds, else torch_native (tests/test_cpu_paged_decode.py)
    assert type(create_attention_backend("auto", pool, pool.device)).__name__ in (
        "CpuFusedBackend",
        "TorchNativeBackend",
    )
    with pytest.raises(ValueError, match="torch_native, .*triton, flashinfer"):
        create_attention_backend("xformers", pool, pool.device)


def test_window_left_keeps_the_same_keys_as_our_window():
    """Ours: keys with pos > q - window (window keys); FlashInfer: q - window_left <= pos <= q."""
    assert window_left(None) == -1
    q = 40
    for window in (1, 5, 24):
        ours = [pos for pos in range(q + 1) if pos > q - window]
        theirs = [pos for pos in range(q + 1) if q - window_left(window) <= pos]
        assert ours == theirs


def _expected(page_table: list[list[int]], seq_lens: list[int], extend_lens: list[int], ps: int):
    """The CSR lists written out request by request."""
    qo, kv, indices, last = [0], [0], [], []
    for pages, seq_len, extend_len in zip(page_table, seq_lens, extend_lens):
        num_pages = -(-seq_len // ps)
        indices += pages[:num_pages]
        qo.append(qo[-1] + extend_len)
        kv.append(kv[-1] + num_pages)
        last.append(seq_len - (num_pages - 1) * ps)
    return qo, kv, indices, last


def _check(inputs, page_table, seq_lens, extend_lens, ps) -> None:
    qo, kv, indices, last = _expected(page_table, seq_lens, extend_lens, ps)
    assert inputs.qo_indptr.tolist() == qo
    assert inputs.kv_indptr.tolist() == kv
    assert inputs.kv_indices.tolist() == indices
    assert inputs.kv_last_page_len.tolist() == last
    for t in inputs:
        assert t.dtype == torch.int32
    assert all(1 <= n <= ps for n in last)


def test_plan_inputs_of_a_mixed_batch_built_like_the_scheduler():
    """Two extends over cached prefixes, a fresh prefill and two decodes; page size 4."""
    tables = [[7, 3, 12], [9], [2, 5, 6, 8], [4, 10], [11, 13, 14, 15, 1]]
    prefix = [6, 0, 13, 4, 16]
    new = [[1] * 5, [2, 3], [4], [5], [6]]  # seq_lens 11, 2, 14, 5, 17
    batch = ForwardBatch.build(new, prefix, tables, 4)
    inputs = paged_kv_plan_inputs(batch.page_table, batch.seq_lens, batch.extend_lens, 4)
    _check(inputs, tables, batch.seq_lens, batch.extend_lens, 4)
    assert inputs.kv_indices.tolist() == [7, 3, 12, 9, 2, 5, 6, 8, 4, 10, 11, 13, 14, 15, 1]
    assert inputs.kv_last_page_len.tolist() == [3, 2, 2, 1, 1]
    assert inputs.qo_indptr.tolist() == [0, 5, 7, 8, 9, 10]


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_plan_inputs_of_random_ragged_batches(ps):
    rng = random.Random(ps)
    for _ in range(20):
        num_reqs = rng.randint(1, 7)
        seq_lens = [rng.randint(1, 70) for _ in range(num_reqs)]
        extend_lens = [rng.randint(1, n) for n in seq_lens]
        pages = list(range(1, 1000))
        rng.shuffle(pages)
        tables = []
        for n in seq_lens:  # some tables hold spare pages past the sequence, as padding does
            count = -(-n // ps) + rng.randint(0, 2)
            tables.append([pages.pop() for _ in range(count)])
        width = max(len(t) for t in tables)
        page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        inputs = paged_kv_plan_inputs(page_table, seq_lens, extend_lens, ps)
        _check(inputs, tables, seq_lens, extend_lens, ps)


def test_plan_inputs_address_the_same_slots_as_the_page_table():
    """Read FlashInfer's way (pages of the NHD view, last page cut), the lists give each
    request exactly the pool slots of its positions, so the kernels see what torch_native sees."""
    ps, pool = 4, _cpu_pool()
    pool.k.copy_(torch.randn_like(pool.k))
    tables, seq_lens = [[3, 9, 1], [12], [5, 7]], [10, 1, 8]
    page_table = torch.tensor([t + [0] * (3 - len(t)) for t in tables])
    inputs = paged_kv_plan_inputs(page_table, seq_lens, [1, 1, 1], ps)
    k_layer = pool.layer_kv(1)[0]
    nhd = k_layer.view(-1, ps, *k_layer.shape[1:])  # [num_pages, page_size, kv_heads, head_dim]
    for i, seq_len in enumerate(seq_lens):
        start, end = inputs.kv_indptr[i], inputs.kv_indptr[i + 1]
        keys = nhd[inputs.kv_indices[start:end].long()].flatten(0, 1)
        keys = keys[: (end - start - 1) * ps + inputs.kv_last_page_len[i]]
        slots = [tables[i][p // ps] * ps + p % ps for p in range(seq_len)]
        assert torch.equal(keys, k_layer[slots])


@pytest.mark.skipif(not HAS_CUDA_FLASHINFER, reason="flashinfer kernels need CUDA + flashinfer")
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_flashinfer_matches_torch_native_on_cuda(tiny_models, arch):
    def runner(backend):
        return ModelRunner.create(
            LoadConfig(model=str(tiny_models[arch]), device="cuda", dtype="float16"),
            CacheConfig(page_size=4, max_total_tokens=1024, attention_backend=backend),
        )

    prompts = [[(i * 31 + j * 7) % 256 for j in range(n)] for i, n in enumerate([30, 5, 19])]
    outputs = []
    for r in (runner("torch_native"), runner("flashinfer")):
        tables = [r.pool.extend_page_table([], len(p) + 1) for p in prompts]
        warm = ForwardBatch.build([p[:4] for p in prompts], [0] * 3, tables, 4, "cuda")
        r.forward(warm)
        mixed = ForwardBatch.build([p[4:] for p in prompts], [4] * 3, tables, 4, "cuda")
        first = r.forward(mixed).last
        decode = ForwardBatch.build(
            [[1]] * 3, [len(p) for p in prompts], tables, 4, "cuda"
        )  # one decode step through the (graph-replayed) decode path
        outputs.append((first, r.forward(decode).last))
    for got, want in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)


TREE_PARENTS = [0, 0, 1, 1, 2]  # root: 1, 2; node 1: 3, 4; node 2: 5


def _tree_batch() -> ForwardBatch:
    """A decode, a draft tree after two plain tokens over a prefix of 9, a plain extend."""
    tables = [[1, 2, 3], [4, 5, 6, 7, 10], [8, 9]]
    tokens = [[1], [5] * (2 + 1 + len(TREE_PARENTS)), [7] * 3]
    return ForwardBatch.build(
        tokens, [10, 9, 4], tables, 4, tree_parents=[None, TREE_PARENTS, None]
    )


def test_tree_batch_mask_is_each_requests_mask_flattened():
    """FlashInfer's custom_mask layout: request by request, [qo_len, kv_len] row-major; the
    tree's nodes see the prefix, the plain tokens and their ancestors, the window along paths."""
    batch = _tree_batch()
    for window in (None, 6):
        flat = tree_batch_mask(batch, window)
        lens = [e * s for e, s in zip(batch.extend_lens, batch.seq_lens)]
        assert flat.dtype == torch.bool and flat.shape == (sum(lens),)
        decode, tree, plain = flat.split(lens)
        assert decode.all() if window is None else decode.sum() == window
        tree = tree.view(8, 17)
        node4 = [True] * 13 + [False, False, True, False]  # prefix, 2 plain, root, node 1, itself
        if window is not None:  # at position 9 + 2 + 2 = 13: keys 8 .. 13 along its path
            node4[:8] = [False] * 8
        assert tree[2 + 4].tolist() == node4
        causal = torch.ones(3, 7, dtype=torch.bool).tril(4)
        if window is not None:
            causal &= ~torch.ones(3, 7, dtype=torch.bool).tril(4 - window)
        assert torch.equal(plain.view(3, 7), causal)


@pytest.mark.skipif(not HAS_CUDA_FLASHINFER, reason="flashinfer kernels need CUDA + flashinfer")
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_flashinfer_tree_verify_matches_torch_native_on_cuda(tiny_models, arch):
    outputs = []
    for backend in ("torch_native", "flashinfer"):
        r = ModelRunner.create(
            LoadConfig(model=str(tiny_models[arch]), device="cuda", dtype="float16"),
            CacheConfig(page_size=4, max_total_tokens=1024, attention_backend=backend),
        )
        tables = [r.pool.extend_page_table([], n) for n in (11, 17, 7)]
        r.forward(ForwardBatch.build([[3] * 10, [4] * 9, [5] * 4], [0] * 3, tables, 4, "cuda"))
        batch = ForwardBatch.build(
            [[1], [5] * 8, [7] * 3], [10, 9, 4], tables, 4, "cuda", return_all_logits=True,
            tree_parents=[None, TREE_PARENTS, None],
        )  # fmt: skip
        outputs.append(r.forward(batch).all)
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-2, rtol=0)
