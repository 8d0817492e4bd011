"""The batch-invariant dense matmul (native/csrc/dense_matmul.cpp, used by
--enable-deterministic-inference): close to the float64 product, every row bitwise the same
alone, at any place in any batch and on 1 or 2 threads, for fp32 / bf16 activations and
weights and shapes that do not fill a 64-column group. Properties of our kernel, so they hold
on any CPU; tests/test_cpu_isa_paths.py runs them under each SIMD level and checks the levels
agree bitwise."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import assert_same_bits_on_one_and_two_threads

from radixserve.model.quant.batch_invariant import (
    BatchInvariantLinear,
    dense_matmul,
    pack_dense_weight,
    unpack_dense_weight,
)

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(96, 128), (64, 64), (200, 72), (1, 33), (576, 576), (130, 1100)]  # (N, K)
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 40]


@pytest.fixture(scope="module", autouse=True)
def ops(cpu_ops):
    return cpu_ops


def _data(n: int, k: int, m: int, x_dtype, w_dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(w_dtype)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    return x, weight


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_dense_mm_is_the_product_and_each_row_its_one_row_call(n, k, x_dtype, w_dtype):
    x, weight = _data(n, k, 40, x_dtype, w_dtype)
    packed = pack_dense_weight(weight)
    out = dense_matmul(x, packed, n)
    assert out.shape == (40, n) and out.dtype == torch.float32
    exact = x.double() @ weight.double().T
    torch.testing.assert_close(out.double(), exact, atol=1e-5 * k**0.5, rtol=1e-5)
    for m in ROW_COUNTS:
        assert torch.equal(dense_matmul(x[:m], packed, n), out[:m]), m
    for i in (0, 7, 39):
        assert torch.equal(dense_matmul(x[i : i + 1], packed, n), out[i : i + 1]), i


def test_a_row_is_the_same_bits_at_any_place_of_any_batch():
    n, k = 200, 72
    row, weight = _data(n, k, 1, torch.float32, torch.float32, seed=3)
    packed = pack_dense_weight(weight)
    alone = dense_matmul(row, packed, n)[0]
    for m in [2, 6, 16, 33, 130]:
        for place in sorted({0, m // 2, m - 1}):
            batch = torch.randn(m, k)
            batch[place] = row[0]
            assert torch.equal(dense_matmul(batch, packed, n)[place], alone), (m, place)


def test_one_and_two_threads_give_the_same_bits():
    x, weight = _data(576, 576, 9, torch.float32, torch.float32)
    packed = pack_dense_weight(weight)
    assert_same_bits_on_one_and_two_threads(lambda: dense_matmul(x, packed, 576))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_pads_to_64_outputs_and_unpacks_to_the_weight(dtype):
    weight = torch.randn(70, 24).to(dtype)
    packed = pack_dense_weight(weight)
    assert packed.shape == (128 // 16, 24, 16) and packed.dtype == dtype
    assert torch.equal(unpack_dense_weight(packed, 70), weight)
    padding = packed[4:].transpose(1, 2).reshape(64, 24)[6:]
    assert torch.equal(padding, torch.zeros(58, 24, dtype=dtype))


def test_zero_rows_give_an_empty_result():
    x, weight = _data(96, 128, 0, torch.float32, torch.float32)
    assert dense_matmul(x, pack_dense_weight(weight), 96).shape == (0, 96)


def test_bad_arguments_are_refused_with_the_reason():
    x, weight = _data(96, 128, 3, torch.float32, torch.float32)
    packed = pack_dense_weight(weight)
    with pytest.raises(RuntimeError, match="N must be the packed weight's row count"):
        dense_matmul(x, packed, 200)
    with pytest.raises(RuntimeError, match="K = x.size"):
        dense_matmul(x[:, :64], packed, 96)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16"):
        dense_matmul(x.half(), packed, 96)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layer_adds_its_bias_in_fp32_and_rounds_once(dtype):
    linear = torch.nn.Linear(72, 200, dtype=dtype).requires_grad_(False)
    layer = BatchInvariantLinear.from_linear(linear)
    x = torch.randn(5, 3, 72, dtype=dtype)
    expected = (x.double() @ linear.weight.double().T + linear.bias.double()).to(dtype)
    out = layer(x)
    assert out.shape == (5, 3, 200) and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


def test_without_the_kernel_rows_run_one_at_a_time_alike(monkeypatch):
    linear = torch.nn.Linear(72, 200).requires_grad_(False)
    layer = BatchInvariantLinear.from_linear(linear)
    monkeypatch.setattr(layer, "_kernel", False)
    x = torch.randn(9, 72)
    out = layer(x)
    torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(layer(x[4:5]), out[4:5])
