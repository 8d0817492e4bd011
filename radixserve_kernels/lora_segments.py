"""Segmented multi-LoRA in Triton: every adapter's delta on its own rows of a batch.

    rows      [m] int64, the adapter rows grouped by segment: segment s is
              rows[offsets[s] .. offsets[s+1]], served by pool slot slots[s]
    at [P, K, Rp] = A^T, bt [P, Rp, N] = B^T (scale in B) per pool slot, ranks [P] each
              slot's rank padded to a multiple of 16 (0, or a slot of P or more: the slot
              has no weights in this projection)
    out[rows] += (x[rows] @ at[slot]) @ bt[slot]              (out updated in place)

Two launches, as SGLang's Triton LoRA backend splits its shrink and expand: the shrink
writes t [m, Rp] (fp32), a program per (segment, BLOCK_M rows, BLOCK_R ranks); the expand a
program per (segment, BLOCK_M rows, BLOCK_N outputs), adding into `out` (rows are unique,
so no two programs write one element). Segments without a rank, and row blocks past a
segment's end, return at once. fp32 dots are exact-product (ieee); 16-bit inputs dot in
their dtype with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tl.dot needs every tile dim >= 16
BLOCK_R = 16
BLOCK_K = 32
BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr, rows_ptr, offsets_ptr, slots_ptr, ranks_ptr, at_ptr, t_ptr, K, P,
    stride_x, stride_as, stride_ak, stride_t,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    seg, pid_m, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(offsets_ptr + seg), tl.load(offsets_ptr + seg + 1)
    slot = tl.load(slots_ptr + seg)
    rank = tl.load(ranks_ptr + slot, mask=slot < P, other=0)
    if start + pid_m * BLOCK_M >= end or pid_r * BLOCK_R >= rank:
        return
    m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < end
    rows = tl.load(rows_ptr + m, mask=m_mask, other=0)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xs = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        ws = tl.load(at_ptr + slot * stride_as + k[:, None] * stride_ak + r[None, :],
                     mask=k_mask[:, None], other=0.0)  # fmt: skip
        acc += _dot(xs, ws, DOT_FP32)
    tl.store(t_ptr + m[:, None] * stride_t + r[None, :], acc, mask=m_mask[:, None])


@triton.jit
def _expand_kernel(
    t_ptr, rows_ptr, offsets_ptr, slots_ptr, ranks_ptr, bt_ptr, out_ptr, N, P,
    stride_t, stride_bs, stride_br, stride_o,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seg, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(offsets_ptr + seg), tl.load(offsets_ptr + seg + 1)
    slot = tl.load(slots_ptr + seg)
    rank = tl.load(ranks_ptr + slot, mask=slot < P, other=0)
    if start + pid_m * BLOCK_M >= end or rank == 0:
        return
    m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < end
    rows = tl.load(rows_ptr + m, mask=m_mask, other=0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ts = tl.load(t_ptr + m[:, None] * stride_t + r[None, :], mask=m_mask[:, None], other=0.0)
        ws = tl.load(bt_ptr + slot * stride_bs + r[:, None] * stride_br + n[None, :],
                     mask=n_mask[None, :], other=0.0)  # fmt: skip
        acc += _dot(ts.to(ws.dtype), ws, DOT_FP32)
    mask = m_mask[:, None] & n_mask[None, :]
    out_offs = rows[:, None] * stride_o + n[None, :]
    old = tl.load(out_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, (old + acc).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))


def segmented_lora(
    out: torch.Tensor,  # [n, N], updated in place
    x: torch.Tensor,  # [n, K]
    rows: torch.Tensor,  # [m] int64
    offsets: torch.Tensor,  # [S + 1] int64
    slots: torch.Tensor,  # [S] int64
    ranks: torch.Tensor,  # [P] int64, multiples of 16
    at: torch.Tensor,  # [P, K, Rp]
    bt: torch.Tensor,  # [P, Rp, N]
    longest: int,  # rows of the longest segment (the grid's row blocks)
) -> None:
    """out[rows of segment s] += (x[rows] @ at[slots[s]]) @ bt[slots[s]], in place."""
    if rows.numel() == 0:
        return
    x, at, bt = x.contiguous(), at.contiguous(), bt.contiguous()
    assert out.is_contiguous() and at.shape[2] % BLOCK_R == 0
    num_segments, rp = slots.shape[0], at.shape[2]
    t = torch.empty(rows.numel(), rp, dtype=torch.float32, device=x.device)
    dot_fp32 = x.dtype == torch.float32
    row_blocks = triton.cdiv(longest, BLOCK_M)
    _shrink_kernel[(num_segments, row_blocks, rp // BLOCK_R)](
        x, rows, offsets, slots, ranks, at, t, x.shape[1], ranks.shape[0],
        x.stride(0), at.stride(0), at.stride(1), t.stride(0),
        DOT_FP32=dot_fp32, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    n = out.shape[1]
    _expand_kernel[(num_segments, row_blocks, triton.cdiv(n, BLOCK_N))](
        t, rows, offsets, slots, ranks, bt, out, n, ranks.shape[0],
        t.stride(0), bt.stride(0), bt.stride(1), out.stride(0),
        DOT_FP32=dot_fp32, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
    )  # fmt: skip
