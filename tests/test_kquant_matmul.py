"""The C++ K-quant kernels (Q4_K, Q5_K, Q6_K super-blocks as GGUF stores them): their
dequantization bit for bit the gguf package's, the matmul against the fp64 one, each row the
same alone or in any batch, and one thread or two the same bits; our reference quantizer
against the gguf package's dequantizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from kernel_checks import assert_same_bits_on_one_and_two_threads, assert_within_fp32_rounding
from kquant_reference import quantize_kquant

from radixserve.model.quant.kquant import (
    KQUANT_TYPES,
    KQuantLinear,
    kquant_dequantize,
    kquant_matmul,
)

SHAPES = [(256, 37), (768, 5), (512, 129)]  # (K, N): one to three super-blocks, odd N
BATCHES = range(1, 41)
# rms error of a weight / rms weight, Gaussian weights (Q4_0 / Q5_0 / Q8_0 measure 0.086 /
# 0.043 / 0.005 on the same data)
ROUND_TRIP_ERROR = {"Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02}


def random_blocks(n: int, k: int, type_name: str, seed: int) -> np.ndarray:
    """Random bytes (every code, scale and sign pattern) with finite, moderate fp16 d / dmin."""
    rng = np.random.default_rng(seed)
    _, size = KQUANT_TYPES[type_name]
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    halves = (rng.standard_normal((n, k // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        blocks[..., 208:210] = halves[..., :2]
    else:
        blocks[..., 0:4] = halves.reshape(n, k // 256, 4)
    return blocks.reshape(n, -1)


def reference_weight(blocks: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize(blocks, T[type_name]), dtype=np.float32))


@pytest.mark.parametrize("type_name", list(KQUANT_TYPES))
def test_reference_quantizer_round_trips_through_ggufs_dequantizer(type_name):
    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    weight[3] = 0.0  # an all-zero row: exact zeros back
    weight[5, :256] = 0.01  # a constant super-block
    blocks = quantize_kquant(weight, type_name)
    assert blocks.shape == (16, 2 * KQUANT_TYPES[type_name][1]) and blocks.dtype == np.uint8
    back = dequantize(blocks, T[type_name])
    rms = np.sqrt(((back - weight) ** 2).mean() / (weight**2).mean())
    assert rms < ROUND_TRIP_ERROR[type_name]
    assert np.all(back[3] == 0) and np.abs(back[5, :256] - 0.01).max() < 1e-4


@pytest.mark.parametrize("type_name", list(KQUANT_TYPES))
def test_kernel_dequantize_is_ggufs_dequantization_bit_for_bit(cpu_ops, type_name):
    blocks = random_blocks(19, 768, type_name, seed=5)
    ours = kquant_dequantize(torch.from_numpy(blocks), KQUANT_TYPES[type_name][0])
    assert torch.equal(ours, reference_weight(blocks, type_name))


def _check(matmul, weight: torch.Tensor, k: int) -> None:
    """Every batch size of BATCHES, fp32 and bf16 inputs, against the fp64 x @ weight.T
    (bound: fp32 summation of K terms, plus the output's rounding to bf16); row i of every
    batch bitwise equal to the one-row call on it."""
    x = torch.randn(max(BATCHES), k)
    for dtype, out_eps in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-8)):
        xs = x.to(dtype)
        alone = torch.cat([matmul(xs[i : i + 1]) for i in range(len(xs))])
        assert alone.dtype == dtype
        expected = xs.double() @ weight.double().t()
        magnitude = xs.double().abs() @ weight.double().abs().t()
        bound = magnitude * k * 2.0**-24 + expected.abs() * out_eps
        assert ((alone.double() - expected).abs() <= bound).all(), dtype
        for m in BATCHES:
            assert torch.equal(matmul(xs[:m]), alone[:m]), (dtype, m)


@pytest.mark.parametrize("type_name", list(KQUANT_TYPES))
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_kernel_equals_the_fp64_matmul_and_each_row_its_one_row_call(cpu_ops, type_name, k, n):
    blocks = random_blocks(n, k, type_name, seed=k + n)
    weight = reference_weight(blocks, type_name)
    qtype, packed = KQUANT_TYPES[type_name][0], torch.from_numpy(blocks)
    _check(lambda x: kquant_matmul(x, packed, qtype), weight, k)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_output_rows_split_over_threads_give_the_same_bits(cpu_ops, type_name):
    packed = torch.from_numpy(random_blocks(301, 512, type_name, seed=3))
    qtype = KQUANT_TYPES[type_name][0]
    x = torch.randn(5, 512)
    assert_same_bits_on_one_and_two_threads(lambda: kquant_matmul(x, packed, qtype))


def test_layer_runs_the_kernel_then_dequantizes_past_dequant_min_rows(cpu_ops):
    blocks = torch.from_numpy(random_blocks(48, 512, "Q5_K", seed=9))
    layer = KQuantLinear(blocks, "Q5_K")
    assert (layer.in_features, layer.out_features, layer.compute_dtype) == (512, 48, None)
    weight = reference_weight(blocks.numpy(), "Q5_K")
    assert torch.equal(layer.dequantize(), weight)
    gen = torch.Generator().manual_seed(9)
    for m in (1, 5, layer.dequant_min_rows + 1):  # the last: dequantize + one dense matmul
        x = torch.randn(m, 512, generator=gen)
        assert_within_fp32_rounding(layer(x), x, weight)  # a fixed atol was flaky: BLAS sums
    with pytest.raises(ValueError, match=r"Q4_K blocks must be \[out, in / 256 \* 144\] uint8"):
        KQuantLinear(blocks, "Q4_K")
