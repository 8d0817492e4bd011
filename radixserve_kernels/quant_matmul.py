"""Weight-only quantized matmul in Triton: out = x @ dequant(W).T, fp32 accumulation.

Weights keep nn.Linear's [out, in] orientation; the codes are never dequantized to memory.

    int4   packed [out, in // 2] uint8: byte j of a row = code 2j (low 4 bits) | code 2j+1
           (high 4 bits); scales, zeros [groups, out]; w = (q - 8) * scale + zero
    int8   qweight [out, in] int8; scales [out] (per channel) or [groups, out]; w = q * scale

One program computes a BLOCK_M x BLOCK_N tile of out over a range of BLOCK_K tiles of the
input dim (split-K when M is small, so that decode still fills the GPU; the partial sums
are added in fp32). BLOCK_K divides the group size, so a K tile lies in one group and the
scales factor out of its dot: acc += (x @ (q - 8)) * scale + sum(x) * zero. The integer
codes are exact in fp16/bf16, so no precision is lost before the fp32 accumulation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INT4_MID = 8  # code q stands for (q - 8) * scale + zero
MIN_DOT = 16  # tl.dot needs every tile dim >= 16


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, group_size, tiles_per_split,
    stride_xm, stride_wn, stride_sg, stride_os, stride_om,
    BITS: tl.constexpr, GROUPED: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in range(first, last):
        if BITS == 4:
            part, x_sum = _int4_tile(x_ptr, w_ptr, rows, cols, row_mask, col_mask, tile, K,
                                     stride_xm, stride_wn, DOT_FP32, BLOCK_K)  # fmt: skip
        else:
            part = _int8_tile(x_ptr, w_ptr, rows, cols, row_mask, col_mask, tile, K,
                              stride_xm, stride_wn, DOT_FP32, BLOCK_K)  # fmt: skip
        if GROUPED:
            group_offs = (tile * BLOCK_K // group_size) * stride_sg + cols
            scale = tl.load(scale_ptr + group_offs, mask=col_mask, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
            if BITS == 4:
                zero = tl.load(zero_ptr + group_offs, mask=col_mask, other=0.0).to(tl.float32)
                acc += x_sum[:, None] * zero[None, :]
        else:
            acc += part
    if not GROUPED:  # one scale per output channel: applied once, after the whole sum
        acc *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_offs = split * stride_os + rows[:, None] * stride_om + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """[m, k] @ [k, n] in fp32 (exact fp32 products) or in a's 16-bit dtype."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))


@triton.jit
def _int4_tile(x_ptr, w_ptr, rows, cols, row_mask, col_mask, tile, K, stride_xm, stride_wn,
               DOT_FP32: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """x[:, tile] @ (q - 8)[tile, :] and the row sums of x[:, tile]: even and odd inputs
    are two half-K dots against the low and the high nibbles (no interleaving needed)."""
    byte = tile * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    k_mask = 2 * byte < K
    w_offs = cols[None, :] * stride_wn + byte[:, None]
    packed = tl.load(w_ptr + w_offs, mask=k_mask[:, None] & col_mask[None, :], other=0)
    packed = packed.to(tl.int32)
    low = (packed & 0xF) - INT4_MID  # [BLOCK_K // 2, BLOCK_N]
    high = (packed >> 4) - INT4_MID
    x_mask = row_mask[:, None] & k_mask[None, :]
    x_offs = rows[:, None] * stride_xm + 2 * byte[None, :]
    x_even = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
    x_odd = tl.load(x_ptr + x_offs + 1, mask=x_mask, other=0.0)
    part = _dot(x_even, low, DOT_FP32) + _dot(x_odd, high, DOT_FP32)
    x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)
    return part, x_sum


@triton.jit
def _int8_tile(x_ptr, w_ptr, rows, cols, row_mask, col_mask, tile, K, stride_xm, stride_wn,
               DOT_FP32: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """x[:, tile] @ q[tile, :] for int8 codes q."""
    ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    q = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None],
                mask=k_mask[:, None] & col_mask[None, :], other=0)  # fmt: skip
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
    return _dot(x, q, DOT_FP32)


@dataclass(frozen=True)
class QuantMatmulConfig:
    """Tile sizes and split-K count of one launch (None: picked from the shape)."""

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    split_k: int | None = None


def int4_matmul(
    x: torch.Tensor,  # [M, K] fp32 / fp16 / bf16
    packed: torch.Tensor,  # [N, K // 2] uint8 (pack_int4)
    scales: torch.Tensor,  # [K // group_size, N]
    zeros: torch.Tensor,  # [K // group_size, N]
    group_size: int,
    config: QuantMatmulConfig = QuantMatmulConfig(),
) -> torch.Tensor:
    """x @ ((q - 8) * scale + zero).T -> [M, N] in x's dtype."""
    _check_group_size(x.shape[1], group_size, "int4")
    if packed.shape[1] * 2 != x.shape[1]:
        raise ValueError(f"int4_matmul: packed is {tuple(packed.shape)}, x has K={x.shape[1]}")
    return _launch(x, packed, scales, zeros, group_size, 4, config)


def int8_matmul(
    x: torch.Tensor,  # [M, K] fp32 / fp16 / bf16
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N] (per channel) or [K // group_size, N]
    group_size: int | None = None,
    config: QuantMatmulConfig = QuantMatmulConfig(),
) -> torch.Tensor:
    """x @ (q * scale).T -> [M, N] in x's dtype."""
    if group_size is not None:
        _check_group_size(x.shape[1], group_size, "int8")
    if qweight.shape[1] != x.shape[1]:
        raise ValueError(f"int8_matmul: qweight is {tuple(qweight.shape)}, x has K={x.shape[1]}")
    return _launch(x, qweight, scales, scales, group_size, 8, config)


def _check_group_size(in_features: int, group_size: int, what: str) -> None:
    if group_size % 32 or in_features % group_size:
        raise ValueError(
            f"{what}_matmul: group_size={group_size} must be a multiple of 32 dividing "
            f"in_features={in_features}"
        )


def _launch(x, weight, scales, zeros, group_size, bits, config) -> torch.Tensor:
    x, weight = x.contiguous(), weight.contiguous()  # no copies when already contiguous
    scales, zeros = scales.contiguous(), zeros.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    bm, bn, bk = _tiles(m, group_size, config)
    grid_m, grid_n, num_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn), triton.cdiv(k, bk)
    split_k = config.split_k or _split_k(x.device, grid_m * grid_n, num_tiles)
    tiles_per_split = triton.cdiv(num_tiles, split_k)
    split_k = triton.cdiv(num_tiles, tiles_per_split)
    out_dtype = x.dtype if split_k == 1 else torch.float32
    out = torch.empty(split_k, m, n, dtype=out_dtype, device=x.device)
    grouped = group_size is not None
    _quant_matmul_kernel[(grid_m, grid_n, split_k)](
        x, weight, scales, zeros, out, m, n, k, group_size or k, tiles_per_split,
        x.stride(0), weight.stride(0), scales.stride(0) if grouped else 0,
        out.stride(0), out.stride(1),
        BITS=bits, GROUPED=grouped, DOT_FP32=_dot_fp32(x.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    return out[0] if split_k == 1 else out.sum(dim=0).to(x.dtype)


def _tiles(m: int, group_size: int | None, config: QuantMatmulConfig) -> tuple[int, int, int]:
    """BLOCK_M grows with M (decode: 16, the smallest tl.dot tile); BLOCK_K divides the
    group size so that each K tile has one scale per column."""
    bm = config.block_m or min(64, max(MIN_DOT, triton.next_power_of_2(m)))
    bn = config.block_n or (64 if m <= MIN_DOT else 128)
    bk = config.block_k or min(64, group_size or 64)
    if group_size is not None and group_size % bk:
        raise ValueError(f"block_k={bk} must divide group_size={group_size}")
    return bm, bn, bk


def _split_k(device: torch.device, num_tiles_mn: int, num_tiles_k: int) -> int:
    """Enough programs for two waves on the GPU's SMs; 1 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(num_tiles_k, 2 * sms // num_tiles_mn))


def _dot_fp32(dtype: torch.dtype) -> bool:
    """fp32 activations keep exact products; the interpreter's 16-bit dot is wrong, so
    there every dot runs in fp32."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in 0..15 -> [N, K // 2] uint8: code 2j in the low 4 bits of byte j."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [N, K // 2] uint8 -> [N, K] int32 codes."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)
