"""cpu_fused: the C++ paged decode and paged extend kernels against the torch_native
reference, the engine with them on and off, and the fallback when they cannot be built."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from kernel_checks import torch_threads

from conftest import SYSTEM, greedy, greedy_generate, make_engine, prompt_ids
from radixserve.attention import create_attention_backend
from radixserve.attention.cpu_fused import CpuFusedBackend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.cache.kv_pool import KVPool, PoolShape
from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.runner import ModelRunner
from radixserve.native import extension as cpu_extension
from radixserve.native.extension import CpuExtensionUnavailable, load_cpu_ops

# fp32 K/V (bf16 K/V widen exactly): both sides compute in fp32, apart in summation order only.
FP32_TOL = dict(atol=2e-5, rtol=0)
# bf16 query: the reference's SDPA rounds in bf16 throughout, the kernel once: a few ulps apart.
BF16_TOL = dict(atol=3e-2, rtol=0)


@pytest.fixture(scope="module")
def ops(cpu_ops):
    return cpu_ops


def _pool(page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVPool:
    pool = KVPool(PoolShape(1, 2400 // page_size + 1, page_size, kv_heads, head_dim), dtype, "cpu")
    pool.k.normal_()
    pool.v.normal_()
    return pool


def _page_tables(
    lens: list[int], page_size: int, num_pages: int, seed: int, num_shared: int | None = None
) -> list[list[int]]:
    """Shuffled pages (so every table has holes: ids out of order, unused pages between) where
    request 1 reuses request 0's first pages, as two requests sharing a cached prefix do
    (`num_shared` of them; default: all but the last page of the shorter)."""
    rng = random.Random(seed)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    tables = []
    for i, n in enumerate(-(-length // page_size) for length in lens):
        most = min(n, len(tables[0])) - 1 if i == 1 else 0
        shared = tables[0][: most if num_shared is None else min(most, num_shared)] if i else []
        fresh, free = free[: n - len(shared)], free[n - len(shared) :]
        tables.append(shared + fresh)
    return tables


def _attend(backend, batch: ForwardBatch, q, k, v) -> torch.Tensor:
    backend.init_forward(batch)
    return backend.forward(q, k, v, 0, batch)


def _decode_case(pool: KVPool, lens: list[int], heads: int, q_dtype=torch.float32, seed=0):
    """A decode batch over `pool` (one new token per request) and its q, k, v."""
    shape = pool.shape
    tables = _page_tables(lens, shape.page_size, shape.num_pages, seed)
    batch = ForwardBatch.build([[1]] * len(lens), [n - 1 for n in lens], tables, shape.page_size)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), heads, shape.head_dim, generator=gen).to(q_dtype)
    kv_shape = (len(lens), shape.num_kv_heads, shape.head_dim)
    k = torch.randn(kv_shape, generator=gen).to(q_dtype)
    v = torch.randn(kv_shape, generator=gen).to(q_dtype)
    return batch, q, k, v


def _ragged_lens(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1, 2, 16, 17, 300] + [rng.randint(1, 300) for _ in range(5)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "kv_heads,group", [(2, 1), (1, 3), (3, 3), (2, 4), (1, 6), (1, 8), (1, 16)]
)
@pytest.mark.parametrize("head_dim", [64, 24, 80])  # 80: a 64-float V tile and a tail
@pytest.mark.parametrize("window", [None, 24])
def test_kernel_matches_reference_fp32(ops, page_size, kv_heads, group, head_dim, window):
    """Groups 1-8: the grouped kernel (AVX-512: head_dim 64 / 80, AVX2: 24 too: whole vectors;
    the padded softmax at ragged lengths); group 16 and AVX-512's head_dim 24: per head."""
    pool = _pool(page_size, kv_heads, head_dim, torch.float32)
    batch, q, k, v = _decode_case(pool, _ragged_lens(head_dim + group), kv_heads * group)
    expected = _attend(TorchNativeBackend(pool, sliding_window=window), batch, q, k, v)
    fused = CpuFusedBackend(pool, sliding_window=window, ops=ops)
    torch.testing.assert_close(_attend(fused, batch, q, k, v), expected, **FP32_TOL)


@pytest.mark.parametrize("deterministic", [False, True])
def test_graph_decode_metadata_runs_the_same_decode(ops, deterministic):
    """init_graph_decode (static decode batches: CUDA graphs, torch.compile) sets up what
    init_forward would for a pure decode batch."""
    pool = _pool(16, 3, 64, torch.float32)
    batch, q, k, v = _decode_case(pool, _ragged_lens(3), 9)
    fused = CpuFusedBackend(pool, ops=ops, deterministic=deterministic)
    expected = _attend(fused, batch, q, k, v)
    fused.init_graph_decode(batch, torch.tensor(batch.seq_lens))
    torch.testing.assert_close(fused.forward(q, k, v, 0, batch), expected, atol=0, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("q_dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_kernel_matches_reference_bf16_pool(ops, page_size, q_dtype, tol):
    pool = _pool(page_size, 3, 64, torch.bfloat16)
    batch, q, k, v = _decode_case(pool, _ragged_lens(1), 9, q_dtype)
    expected = _attend(TorchNativeBackend(pool), batch, q, k, v)
    got = _attend(CpuFusedBackend(pool, ops=ops), batch, q, k, v)
    assert got.dtype == q_dtype
    torch.testing.assert_close(got.float(), expected.float(), **tol)


@pytest.mark.parametrize("window", [None, 40])
def test_split_positions_merge_to_the_unsplit_result(ops, window):
    """Few requests, positions split over work items and merged by log-sum-exp."""
    pool = _pool(16, 2, 64, torch.float32)
    lens = [300, 1, 77]
    tables = torch.tensor([t + [0] * (19 - len(t)) for t in _page_tables(lens, 16, 151, 3)])
    q = torch.randn(3, 6, 64)
    k_pool, v_pool = pool.layer_kv(0)
    args = (q, k_pool, v_pool, tables, torch.tensor(lens), 16, window or -1, 0.125)
    whole = ops.paged_decode(*args, num_splits=1)
    for num_splits in (2, 3, 7, 64):
        torch.testing.assert_close(
            ops.paged_decode(*args, num_splits=num_splits), whole, **FP32_TOL
        )


def test_more_threads_than_requests_split_on_their_own(ops):
    """With 4 threads and one long request, the kernel splits it (and merges) unasked."""
    pool = _pool(16, 3, 64, torch.float32)
    batch, q, k, v = _decode_case(pool, [700], 9)
    expected = _attend(TorchNativeBackend(pool), batch, q, k, v)
    with torch_threads(4):
        got = _attend(CpuFusedBackend(pool, ops=ops), batch, q, k, v)
    torch.testing.assert_close(got, expected, **FP32_TOL)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("window", [None, 24])
def test_mixed_batch_matches_reference(ops, in_place, window):
    """Decodes, extends over a cached prefix and a fresh prefill in one batch; the cached
    extends through paged_extend (in_place) or through SDPA."""
    pool = _pool(16, 2, 24, torch.float32)
    lens, new = [40, 100, 33, 5, 50], [1, 7, 1, 5, 2]
    tables = _page_tables(lens, 16, pool.shape.num_pages, 5)
    tokens = [[1] * n for n in new]
    batch = ForwardBatch.build(tokens, [n - e for n, e in zip(lens, new)], tables, 16)
    q, k, v = torch.randn(16, 4, 24), torch.randn(16, 2, 24), torch.randn(16, 2, 24)
    expected = _attend(TorchNativeBackend(pool, sliding_window=window), batch, q, k, v)
    fused = CpuFusedBackend(pool, sliding_window=window, ops=ops)
    fused.route_extend = lambda prefix_len, extend_len: in_place and prefix_len > 0
    got = _attend(fused, batch, q, k, v)
    assert (batch.attn_metadata.in_place is not None) == in_place
    torch.testing.assert_close(got, expected, **FP32_TOL)


def _extend_case(pool: KVPool, prefix: list[int], new: list[int], heads: int, q_dtype, seed):
    """An extend batch: request i adds new[i] tokens over prefix[i] cached ones; requests 0
    and 1 share the whole pages both have cached (never a page either writes)."""
    shape = pool.shape
    lens = [p + n for p, n in zip(prefix, new)]
    shared = min(prefix[:2]) // shape.page_size if len(prefix) > 1 else 0
    tables = _page_tables(lens, shape.page_size, shape.num_pages, seed, shared)
    batch = ForwardBatch.build([[1] * n for n in new], prefix, tables, shape.page_size)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch.num_tokens, heads, shape.head_dim, generator=gen).to(q_dtype)
    kv_shape = (batch.num_tokens, shape.num_kv_heads, shape.head_dim)
    k = torch.randn(kv_shape, generator=gen).to(q_dtype)
    v = torch.randn(kv_shape, generator=gen).to(q_dtype)
    return batch, q, k, v


def _all_in_place(pool: KVPool, window: int | None, ops) -> CpuFusedBackend:
    fused = CpuFusedBackend(pool, sliding_window=window, ops=ops)
    fused.route_extend = lambda prefix_len, extend_len: True  # fresh prefills too
    return fused


EXTEND_CASES = [  # (prefix lens, new token counts): ragged, 1..300 new over 0..2,000 cached
    ([0, 17, 2000], [300, 2, 33]),
    ([900, 1200, 31], [40, 250, 16]),
    ([5, 1, 300, 64], [1, 70, 9, 128]),
    ([1999, 0], [1, 65]),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (3, 3), (2, 8)])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("window", [None, 24, 200])
@pytest.mark.parametrize("case", range(len(EXTEND_CASES)))
def test_extend_kernel_matches_reference(ops, page_size, kv_heads, group, head_dim, window, case):
    pool = _pool(page_size, kv_heads, head_dim, torch.float32)
    prefix, new = EXTEND_CASES[case]
    batch, q, k, v = _extend_case(pool, prefix, new, kv_heads * group, torch.float32, case)
    expected = _attend(TorchNativeBackend(pool, sliding_window=window), batch, q, k, v)
    got = _attend(_all_in_place(pool, window, ops), batch, q, k, v)
    torch.testing.assert_close(got, expected, **FP32_TOL)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("q_dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_extend_kernel_matches_reference_bf16_pool(ops, page_size, q_dtype, tol, request):
    if q_dtype == torch.bfloat16:
        request.getfixturevalue("bf16_sdpa")
    """Cached prefixes only: for a fresh prefill torch_native attends to the new K/V as
    computed, not as rounded into the bf16 pool."""
    pool = _pool(page_size, 3, 64, torch.bfloat16)
    batch, q, k, v = _extend_case(pool, [3, 40, 1500], [20, 130, 7], 9, q_dtype, 2)
    expected = _attend(TorchNativeBackend(pool), batch, q, k, v)
    got = _attend(_all_in_place(pool, None, ops), batch, q, k, v)
    assert got.dtype == q_dtype
    torch.testing.assert_close(got.float(), expected.float(), **tol)


def test_extend_kernel_with_threads_and_reused_pages(ops):
    """Four threads over many tiles; requests 0 and 1 share their first pages (as two cache
    hits on one prefix) while each extends past them."""
    pool = _pool(16, 2, 64, torch.float32)
    batch, q, k, v = _extend_case(pool, [160, 160, 3], [90, 41, 200], 6, torch.float32, 9)
    expected = _attend(TorchNativeBackend(pool), batch, q, k, v)
    with torch_threads(4):
        got = _attend(_all_in_place(pool, None, ops), batch, q, k, v)
    torch.testing.assert_close(got, expected, **FP32_TOL)


def test_extend_kernel_rejects_bad_requests(ops):
    pool = _pool(16, 1, 64, torch.float32)
    k_pool, v_pool = pool.layer_kv(0)
    q, one = torch.randn(4, 1, 64), torch.tensor([0])

    def call(table, prefix, ext):
        t = torch.tensor
        return ops.paged_extend(q, k_pool, v_pool, t(table), one, t(prefix), t(ext), one,
                                16, -1, 0.125)  # fmt: skip

    with pytest.raises(RuntimeError, match="is not a page of the pool"):
        call([[1, 10_000]], [20], [4])
    with pytest.raises(RuntimeError, match="page_table width"):
        call([[1]], [20], [4])
    with pytest.raises(RuntimeError, match="runs past q"):
        call([[1, 2]], [0], [5])


def test_kernel_rejects_pages_outside_the_pool(ops):
    pool = _pool(16, 1, 64, torch.float32)
    k_pool, v_pool = pool.layer_kv(0)
    q, lens = torch.randn(1, 1, 64), torch.tensor([20])
    with pytest.raises(RuntimeError, match="is not a page of the pool"):
        ops.paged_decode(q, k_pool, v_pool, torch.tensor([[1, 10_000]]), lens, 16, -1, 0.125)
    with pytest.raises(RuntimeError, match="seq_lens"):
        ops.paged_decode(q, k_pool, v_pool, torch.tensor([[1]]), lens, 16, -1, 0.125)


# ---- the engine with the fused path on and off ----


def test_engine_greedy_identical_fused_on_and_off_cold_and_warm(ops, tiny_chat_model):
    # warm: 208 cached tokens, then extends of 1, 2, 12 and 16 (cpu_fused: all in place)
    prompts = [SYSTEM + prompt_ids(i, n) for i, n in enumerate([9, 10, 20, 40])]
    results = {}
    for backend in ("cpu_fused", "torch_native"):
        engine = make_engine(tiny_chat_model, attention_backend=backend)
        cold = engine.generate(input_ids=prompts, sampling_params=greedy(12))
        warm = engine.generate(input_ids=prompts, sampling_params=greedy(12))
        assert all(w["meta_info"]["cached_tokens"] > 0 for w in warm)
        results[backend] = [o["output_ids"] for o in cold + warm]
    assert results["cpu_fused"] == results["torch_native"]
    assert results["cpu_fused"][:4] == results["cpu_fused"][4:]


def test_engine_greedy_identical_fused_on_and_off_chunked_prefill(ops, tiny_chat_model):
    """64-token chunks: every chunk after the first is an extend over the cached chunks."""
    prompts = [SYSTEM + prompt_ids(i, n) for i, n in enumerate([9, 150])]
    results = {}
    for backend in ("cpu_fused", "torch_native"):
        engine = make_engine(tiny_chat_model, attention_backend=backend, chunked_prefill_size=64)
        out = engine.generate(input_ids=prompts, sampling_params=greedy(8))
        results[backend] = [o["output_ids"] for o in out]
    assert results["cpu_fused"] == results["torch_native"]


def _runner(folder, backend: str, page_size: int = 16, **config) -> ModelRunner:
    """`config`: dtype (LoadConfig) or kv_cache_dtype (CacheConfig)."""
    load = LoadConfig(model=str(folder), device="cpu", dtype=config.get("dtype", "auto"))
    cache = CacheConfig(
        page_size=page_size,
        max_total_tokens=2048,
        attention_backend=backend,
        kv_cache_dtype=config.get("kv_cache_dtype", "auto"),
    )
    return ModelRunner.create(load, cache)


PROMPTS = [[(i * 31 + j * 7) % 256 for j in range(n)] for i, n in enumerate([70, 5, 33])]


@pytest.mark.parametrize("arch", ["mistral", "qwen3", "gemma3"])  # window 24; GQA; hybrid
@pytest.mark.parametrize("page_size", [1, 16])
def test_runner_greedy_identical_fused_on_and_off(ops, tiny_models, arch, page_size):
    fused = _runner(tiny_models[arch], "cpu_fused", page_size)
    native = _runner(tiny_models[arch], "torch_native", page_size)
    inner = getattr(fused.attn, "backends", [fused.attn])  # a hybrid model: one per window
    assert all(isinstance(backend, CpuFusedBackend) for backend in inner)
    assert greedy_generate(fused, PROMPTS, 8) == greedy_generate(native, PROMPTS, 8)


def test_runner_greedy_identical_with_a_bf16_pool(ops, tiny_models):
    """An fp32 model over a bfloat16 pool: both paths widen K/V exactly as they read it."""
    fused = _runner(tiny_models["llama"], "cpu_fused", kv_cache_dtype="bfloat16")
    native = _runner(tiny_models["llama"], "torch_native", kv_cache_dtype="bfloat16")
    assert fused.pool.dtype == torch.bfloat16
    assert greedy_generate(fused, PROMPTS, 8) == greedy_generate(native, PROMPTS, 8)


def test_runner_bf16_model_decode_logits_close(ops, tiny_models, bf16_sdpa):
    """A bfloat16 model: the decode step's logits agree to bf16 precision (the reference's
    SDPA rounds in bf16, the kernel accumulates in fp32)."""
    logits = {}
    for backend in ("cpu_fused", "torch_native"):
        runner = _runner(tiny_models["llama"], backend, dtype="bfloat16")
        pool = runner.pool
        tables = [pool.extend_page_table([], len(p) + 1) for p in PROMPTS]
        runner.forward(ForwardBatch.build(PROMPTS, [0, 0, 0], tables, pool.page_size))
        step = ForwardBatch.build([[3], [4], [5]], [len(p) for p in PROMPTS], tables, 16)
        logits[backend] = runner.forward(step).last
    torch.testing.assert_close(logits["cpu_fused"], logits["torch_native"], atol=5e-2, rtol=0)


# ---- backend choice and the fallback ----


def _small_pool(dtype=torch.float32) -> KVPool:
    return KVPool(PoolShape(1, 8, 16, 1, 64), dtype, "cpu")


def test_auto_on_cpu_is_cpu_fused(ops):
    backend = create_attention_backend("auto", _small_pool(), torch.device("cpu"))
    assert isinstance(backend, CpuFusedBackend)


def test_auto_falls_back_to_torch_native_when_the_build_fails(monkeypatch, caplog):
    """A failed build (simulated, so no machine without g++ is needed) logs one line."""

    def failing_build():
        raise RuntimeError("Error building extension 'radixserve_cpu': simulated\nlog lines")

    monkeypatch.setattr(cpu_extension, "_loaded", None)
    monkeypatch.setattr(cpu_extension, "_failure", None)
    monkeypatch.setattr(cpu_extension, "_build_and_load", failing_build)
    with caplog.at_level(logging.INFO, logger="radixserve.attention"):
        backend = create_attention_backend("auto", _small_pool(), torch.device("cpu"))
    assert type(backend) is TorchNativeBackend
    [record] = caplog.records
    assert "torch_native" in record.message and "simulated" in record.message
    assert "log lines" not in record.message
    with pytest.raises(RuntimeError, match="attention_backend='cpu_fused'.*simulated"):
        create_attention_backend("cpu_fused", _small_pool(), torch.device("cpu"))


@pytest.mark.parametrize(
    ("level", "present", "absent"),
    [("AVX512", "-mavx512f", None), ("AVX2", "-mavx2", "-mavx512f"), ("DEFAULT", None, "-mavx2")],
)
def test_simd_flags_follow_the_level_torch_detected(monkeypatch, level, present, absent):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: level)
    flags = cpu_extension.compiler_flags()
    assert flags[:2] == ["-O3", "-fopenmp"]
    assert present is None or present in flags
    assert absent is None or absent not in flags
    assert cpu_extension.build_key(flags) != cpu_extension.build_key(["-O3", "-fopenmp", "-x"])


def test_missing_compiler_is_reported_as_the_reason(monkeypatch):
    monkeypatch.setattr(cpu_extension, "_loaded", None)
    monkeypatch.setattr(cpu_extension, "_failure", None)
    monkeypatch.setenv("CXX", "radixserve-no-such-compiler")
    with pytest.raises(CpuExtensionUnavailable, match="no C\\+\\+ compiler"):
        load_cpu_ops()


def test_auto_keeps_torch_native_for_a_pool_the_kernel_cannot_read():
    backend = create_attention_backend("auto", _small_pool(torch.float16), torch.device("cpu"))
    assert type(backend) is TorchNativeBackend
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        create_attention_backend("cpu_fused", _small_pool(torch.float16), torch.device("cpu"))
