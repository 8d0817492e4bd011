"""The int4 / int8 dequant-GEMM Triton kernel against its torch reference, on CPU under
TRITON_INTERPRET=1: decode (M=1) to prefill-sized M, ragged M/N (and K for per-channel
int8), each group size, fp32 and fp16 (bf16 where the interpreter's fp32 dots hold)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit of ours runs

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixserve_kernels.quant_matmul import (  # noqa: E402
    QuantMatmulConfig,
    int4_matmul,
    int8_matmul,
    pack_int4,
    unpack_int4,
)
from radixserve_kernels.reference import int4_matmul_ref, int8_matmul_ref  # noqa: E402

# fp32 dots are exact products, fp32 sums in another order; 16-bit: the output's rounding
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
SMALL_TILES = QuantMatmulConfig(block_m=16, block_n=32)  # several N tiles on small shapes


def _int4_weight(n: int, k: int, group_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(n, k // group_size, generator=gen) / 8 + 0.01
    zeros = torch.randn(n, k // group_size, generator=gen) / 4
    return codes, scales, zeros


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=1e-3)


def test_pack_int4_puts_even_codes_in_the_low_nibble_and_round_trips():
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]], dtype=torch.int32)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x0F], [0x87, 0xC3]]
    codes, _, _ = _int4_weight(24, 64, 32)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_matmul_matches_reference(m, group_size):
    n, k = 40, 256  # N = 40: a ragged last tile of 32
    codes, scales, zeros = _int4_weight(n, k, group_size)
    x = _x(m, k, torch.float32)
    got = int4_matmul(x, pack_int4(codes), scales.t(), zeros.t(), group_size, SMALL_TILES)
    _close(got, int4_matmul_ref(x, codes, scales, zeros, group_size), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int4_matmul_16_bit_activations(dtype):
    codes, scales, zeros = _int4_weight(48, 128, 32)
    scales, zeros = scales.to(dtype), zeros.to(dtype)
    x = _x(5, 128, dtype)
    got = int4_matmul(x, pack_int4(codes), scales.t(), zeros.t(), 32, SMALL_TILES)
    _close(got, int4_matmul_ref(x, codes, scales, zeros, 32), dtype)


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("group_size", [None, 32, 64])
def test_int8_matmul_matches_reference(m, group_size):
    k = 100 if group_size is None else 192  # per channel: K ragged against BLOCK_K
    gen = torch.Generator().manual_seed(2)
    qweight = torch.randint(-127, 128, (36, k), generator=gen, dtype=torch.int8)
    groups = () if group_size is None else (k // group_size,)
    scales = torch.rand(36, *groups, generator=gen) / 100
    x = _x(m, k, torch.float32)
    kernel_scales = scales if group_size is None else scales.t()
    got = int8_matmul(x, qweight, kernel_scales, group_size, SMALL_TILES)
    _close(got, int8_matmul_ref(x, qweight, scales, group_size), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_matmul_16_bit_activations(dtype):
    gen = torch.Generator().manual_seed(3)
    qweight = torch.randint(-127, 128, (20, 96), generator=gen, dtype=torch.int8)
    scales = (torch.rand(20, 3, generator=gen) / 100).to(dtype)
    x = _x(3, 96, dtype)
    got = int8_matmul(x, qweight, scales.t(), 32, SMALL_TILES)
    _close(got, int8_matmul_ref(x, qweight, scales, 32), dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_split_k_gives_the_same_sums(bits):
    codes, scales, zeros = _int4_weight(32, 256, 32)
    x = _x(2, 256, torch.float32)
    if bits == 4:
        run = lambda c: int4_matmul(x, pack_int4(codes), scales.t(), zeros.t(), 32, c)  # noqa: E731
    else:
        q = (codes - 8).to(torch.int8)
        run = lambda c: int8_matmul(x, q, scales.t(), 32, c)  # noqa: E731
    one = run(QuantMatmulConfig(block_k=32, split_k=1))
    many = run(QuantMatmulConfig(block_k=32, split_k=3))  # 8 tiles: splits of 3, 3, 2
    torch.testing.assert_close(one, many, atol=1e-4, rtol=1e-5)


def test_bad_shapes_name_the_parameter():
    codes, scales, zeros = _int4_weight(16, 96, 32)
    with pytest.raises(ValueError, match="group_size=64"):
        int4_matmul(_x(1, 96, torch.float32), pack_int4(codes), scales.t(), zeros.t(), 64)
    with pytest.raises(ValueError, match="K=64"):
        int4_matmul(_x(1, 64, torch.float32), pack_int4(codes), scales.t(), zeros.t(), 32)
    with pytest.raises(ValueError, match="block_k=64 must divide group_size=32"):
        config = QuantMatmulConfig(block_k=64)
        int4_matmul(_x(1, 96, torch.float32), pack_int4(codes), scales.t(), zeros.t(), 32, config)
