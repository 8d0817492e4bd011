"""The int8-activation path of the GGUF block layers (native/csrc/q8_matmul.cpp), as llama.cpp
computes its quantized matmuls: each activation row is quantized once per call to q8 blocks
and every weight block meets its activation block in one integer dot product.

    weights (loader's bytes)   activations, per row       per block
    Q4_0 / Q4_1  int4, (d, m)   q8 of 32: d_x, codes, sum  d d_x * sum(q q_x) + m * d_x sum(q_x)
    Q8_0         int8, d        q8 of 32                   d d_x * sum(q q_x)
    Q4_K / Q5_K  256-blocks     q8_K of 256, sums per 16   6-bit scales and mins per 32
    Q6_K         256-blocks     q8_K of 256, sums per 16   int8 scale per 16

Activation codes: d = max|x| / 127 per block, q = round-half-even(x / d) as x * (1 / d)
(`quantize_activations` is the same arithmetic in torch, for tests). Integer sums are exact
and the fp32 ones run in a fixed order per row on every SIMD level (AVX512-VNNI, AVX2,
portable: the same bits; with AVX-512 two blocks share one 512-bit dot and fma, the two
8-lane sets of the other levels side by side), so a row's result does not depend on the
other rows of the call. Against the fp32 path the difference is the activations' rounding,
~0.3% of a dot's size. Which path a layer takes: activation_choice.py; on AVX-512 and AVX2
builds it repacks Q4_K / Q5_K / Q6_K (kquant.py), on AVX-512 builds also Q4_0 / Q4_1
(linear.py's Int4WeightOnlyLinear), 8 rows at a time for their own kernels (X8_TYPE), with the
row layout's bits.
"""

from __future__ import annotations

import functools

import torch

Q8_BLOCK = 32  # activation block of Q4_0 / Q4_1 / Q8_0 (llama.cpp's QK8_0)
Q8K_BLOCK = 256  # activation block of the K-quants (QK_K)
# Weights repacked 8 rows at a time for the 8-row kernels (native/csrc/kquant_blocks.h,
# q8_int4_x8.h): a repacked format's id is its ggml type id + X8_TYPE (ours)
X8_TYPE = 1000
X8_ROWS = 8
Q4_0_X8, Q4_1_X8 = 2 + X8_TYPE, 3 + X8_TYPE


@functools.cache
def kquant_x8_native() -> bool:
    """True where repacked Q4_K / Q5_K / Q6_K run on their own 8-row kernels (AVX-512 and AVX2
    builds); the portable build would unpack them group by group, so layers are not repacked
    there."""
    return _native("kquant_x8_native")


@functools.cache
def int4_x8_native() -> bool:
    """True where repacked Q4_0 / Q4_1 run on their own 8-row kernels (AVX-512 and AVX2
    builds)."""
    return _native("int4_x8_native")


def _native(op: str) -> bool:
    from radixserve.native.extension import CpuExtensionUnavailable

    try:
        load_q8_ops()
    except CpuExtensionUnavailable:
        return False
    return bool(getattr(torch.ops.radixserve_cpu, op)())


@functools.cache
def load_q8_ops() -> None:
    """Loads the extension and tells torch.compile's tracer what the ops return."""
    from radixserve.native.extension import load_cpu_ops

    load_cpu_ops()

    @torch.library.register_fake("radixserve_cpu::int4_block_mm_q8")
    def _int4_fake(x, qs, scale_min):
        return x.new_empty(x.shape[0], qs.shape[0])

    @torch.library.register_fake("radixserve_cpu::int8_block_mm_q8")
    def _int8_fake(x, qs, scales):
        return x.new_empty(x.shape[0], qs.shape[0])

    @torch.library.register_fake("radixserve_cpu::int4_x8_mm_q8")
    def _int4_x8_fake(x, blocks, qtype):
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("radixserve_cpu::kquant_mm_q8")
    def _kquant_fake(x, blocks, qtype):
        return x.new_empty(x.shape[0], blocks.shape[0])


def int4_block_matmul_q8(
    x: torch.Tensor, qs: torch.Tensor, scale_min: torch.Tensor
) -> torch.Tensor:
    """[M, K] fp32 / bf16 @ int4 blocks.T with int8 activations -> [M, N] in x's dtype."""
    return torch.ops.radixserve_cpu.int4_block_mm_q8(x.contiguous(), qs, scale_min)


def int4_x8_matmul_q8(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """[M, K] fp32 / bf16 @ repacked Q4_0 / Q4_1 (Q4_0_X8 / Q4_1_X8) blocks.T with int8
    activations -> [M, N] in x's dtype: int4_block_matmul_q8's bits on the row layout."""
    return torch.ops.radixserve_cpu.int4_x8_mm_q8(x.contiguous(), blocks, qtype)


def int8_block_matmul_q8(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[M, K] fp32 / bf16 @ Q8_0 blocks.T with int8 activations -> [M, N] in x's dtype."""
    return torch.ops.radixserve_cpu.int8_block_mm_q8(x.contiguous(), qs, scales)


def kquant_matmul_q8(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """[M, K] fp32 / bf16 @ K-quant blocks.T with int8 activations -> [M, N] in x's dtype."""
    return torch.ops.radixserve_cpu.kquant_mm_q8(x.contiguous(), blocks, qtype)


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> codes [M, K] int8 and scales [M, K / block] fp32, the kernels' arithmetic in
    torch: d = max|x| / 127, codes round-half-even(x * (1 / d)), 0 where d is 0."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // block, block)
    d = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(m, k), d
