"""cpu_fused with attention soft-capping (Gemma's attn_logit_softcapping): the C++ paged
decode and paged extend kernels against torch_native's capped reference, fp32 and bf16
pools, with and without a window, batched and deterministic; the cap really changes them."""

from __future__ import annotations

import pytest
import torch
from test_cpu_paged_decode import (
    BF16_TOL,
    FP32_TOL,
    _attend,
    _decode_case,
    _extend_case,
    _pool,
    _ragged_lens,
)

from radixserve.attention.cpu_fused import CpuFusedBackend
from radixserve.attention.torch_native import TorchNativeBackend

CAP = 2.0


@pytest.fixture(scope="module")
def ops(cpu_ops):
    return cpu_ops


def _capped_pool(page_size: int, kv_dtype: torch.dtype):
    pool = _pool(page_size, 2, 64, kv_dtype)
    pool.k.mul_(3)  # scores of several units: the cap bends them
    return pool


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("deterministic", [False, True])
def test_capped_decode_matches_reference(ops, page_size, window, deterministic):
    pool = _capped_pool(page_size, torch.float32)
    batch, q, k, v = _decode_case(pool, _ragged_lens(7), 6)
    expected = _attend(TorchNativeBackend(pool, window, logit_cap=CAP), batch, q, k, v)
    fused = CpuFusedBackend(pool, window, logit_cap=CAP, ops=ops, deterministic=deterministic)
    torch.testing.assert_close(_attend(fused, batch, q, k, v), expected, **FP32_TOL)
    plain = _attend(TorchNativeBackend(pool, window), batch, q, k, v)
    assert (plain - expected).abs().max() > 0.05


@pytest.mark.parametrize("kv_dtype,q_dtype,tol", [
    (torch.float32, torch.float32, FP32_TOL),
    (torch.bfloat16, torch.float32, FP32_TOL),
    (torch.bfloat16, torch.bfloat16, BF16_TOL),
])  # fmt: skip
@pytest.mark.parametrize("window", [None, 24])
def test_capped_extend_matches_reference(ops, kv_dtype, q_dtype, tol, window, request):
    if q_dtype == torch.bfloat16:
        request.getfixturevalue("bf16_sdpa")
    pool = _capped_pool(16, kv_dtype)
    batch, q, k, v = _extend_case(pool, [0, 17, 300], [40, 2, 33], 6, q_dtype, 3)
    k, v = (x.to(kv_dtype).to(q_dtype) for x in (k, v))  # the fresh prefill reads them back
    expected = _attend(TorchNativeBackend(pool, window, logit_cap=CAP), batch, q, k, v)
    fused = CpuFusedBackend(pool, window, logit_cap=CAP, ops=ops)
    fused.route_extend = lambda prefix_len, extend_len: True  # the fresh prefill too
    got = _attend(fused, batch, q, k, v)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    plain = _attend(TorchNativeBackend(pool, window), batch, q, k, v)
    assert (plain.float() - expected.float()).abs().max() > 0.05
