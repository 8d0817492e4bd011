"""Paged decode attention in Triton: one query token per request, K/V read via page tables.

Flash-decoding: stage 1 splits each request's context into `num_splits` chunks, each program
computing a partial softmax-weighted sum and its log-sum-exp for one (request, head, chunk);
stage 2 merges the chunks. Dot products are elementwise multiply + sum (no `tl.dot`), so the
kernel has no minimum tile size and runs the same under TRITON_INTERPRET=1 on CPU.

    q: [num_reqs, num_heads, head_dim]       k_cache, v_cache: [num_slots, kv_heads, head_dim]
    page_table: [num_reqs, max_pages]        seq_lens: [num_reqs]     out: like q

`logit_cap` (Gemma's attn_logit_softcapping): scaled scores -> cap * tanh(score / cap) before
the softmax; without it the kernel compiles as before (HAS_CAP is a constexpr).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap); tanh as 2 sigmoid(2x) - 1 (triton.language has no tanh)."""
    return cap * (2.0 * tl.sigmoid(2.0 * (scores / cap)) - 1.0)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
    sm_scale, split_len, logit_cap,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_tb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr,
):  # fmt: skip
    req, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP
    seq_len = tl.load(lens_ptr + req)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + req * stride_qb + head * stride_qh + dims, mask=dim_mask, other=0.0)
    q = q.to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(start, end, BLOCK_N):
        pos = block + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        page = tl.load(table_ptr + req * stride_tb + pos // PAGE_SIZE, mask=pos_mask, other=0)
        slots = page * PAGE_SIZE + pos % PAGE_SIZE
        offs = slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        mask2 = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + offs, mask=mask2, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * sm_scale
        if HAS_CAP:
            scores = soft_cap(scores, logit_cap)
        scores = tl.where(pos_mask, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(v_ptr + offs, mask=mask2, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out_base = req * stride_pb + head * stride_ph + split * stride_ps
    has_work = end > start
    safe_l = tl.where(has_work, l_i, 1.0)
    tl.store(part_out_ptr + out_base + dims, acc / safe_l, mask=dim_mask)
    lse = tl.where(has_work, m_i + tl.log(safe_l), -float("inf"))
    tl.store(part_lse_ptr + req * stride_lb + head * stride_lh + split, lse)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    req, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    lse = tl.load(part_lse_ptr + req * stride_lb + head * stride_lh + splits,
                  mask=split_mask, other=-float("inf"))  # fmt: skip
    weights = tl.exp(lse - tl.max(lse, axis=0))
    weights = weights / tl.sum(weights, axis=0)
    dims = tl.arange(0, BLOCK_D)
    offs = req * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :]
    mask2 = split_mask[:, None] & (dims[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + offs, mask=mask2, other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0)
    tl.store(out_ptr + req * stride_ob + head * stride_oh + dims, out, mask=dims < HEAD_DIM)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float | None = None,
    split_len: int = 256,
    block_n: int = 32,
    num_splits: int | None = None,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged K/V. Returns [reqs, heads, dim].

    `num_splits` fixes the chunk count (CUDA graphs: no host sync, no data-dependent shape;
    chunks past a sequence's end do no work); by default it follows the longest sequence.
    """
    num_reqs, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if num_splits is None:
        num_splits = max(1, triton.cdiv(int(seq_lens.max()), split_len))
    part_out = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)  # fmt: skip
    part_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_reqs, num_heads, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_out, part_lse,
        sm_scale, split_len, logit_cap or 0.0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        HAS_CAP=logit_cap is not None,
    )  # fmt: skip
    out = torch.empty(num_reqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    _decode_merge_kernel[(num_reqs, num_heads)](
        part_out, part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
    )  # fmt: skip
    return out.to(q.dtype)
