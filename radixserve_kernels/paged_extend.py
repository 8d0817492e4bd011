"""Paged extend attention in Triton: a request's new tokens attend causally to themselves and
to its cached prefix, all read through its page table (the path every cache hit takes).

One program per (request, head, block of BLOCK_M new tokens) runs an online softmax over
BLOCK_N-position blocks of the request's context. The new tokens' K/V must already be in
the pool (store_kv first). Tiles are at least 16 wide so `tl.dot` compiles on GPUs; on the
interpreter, and for fp32, the dots run in fp32 (the interpreter's bf16 dot is wrong).

    q: [num_tokens, num_heads, head_dim]   (new tokens of all requests, request by request)
    q_starts, prefix_lens, extend_lens: [num_reqs]    page_table: [num_reqs, max_pages]

Draft trees (speculative verification; `trees`, a TreeMasks): a tree request's new tokens see
the prefix and, among themselves, what its [extend_len, extend_len] ancestor mask allows; each
new token sits at position prefix + depth (the causal limit and the window count along paths).
Without trees the kernel compiles as before (HAS_TREE is a constexpr); so without
`logit_cap` (scores soft-capped as paged_decode's, HAS_CAP).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve_kernels.paged_decode import soft_cap


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, q_starts_ptr, prefix_ptr, extend_ptr,
    tree_mask_ptr, tree_off_ptr, depth_ptr, sm_scale, window, logit_cap,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, HAS_TREE: tl.constexpr, HAS_CAP: tl.constexpr,
):  # fmt: skip
    req, head, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    extend_len = tl.load(extend_ptr + req)
    if m_block * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(prefix_ptr + req)
    q_start = tl.load(q_starts_ptr + req)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < extend_len
    q_pos = prefix_len + rows
    if HAS_TREE:  # positions along each token's path; its request's mask (offset -1: none)
        q_pos = prefix_len + tl.load(depth_ptr + q_start + rows, mask=row_mask, other=0)
        tree_off = tl.load(tree_off_ptr + req)
        tree_rows = row_mask & (tree_off + rows * 0 >= 0)  # a tensor: the interpreter's
        # bool tensor & bool scalar is not a mask
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_offs = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_end = prefix_len + tl.minimum((m_block + 1) * BLOCK_M, extend_len)
    for block in range(0, kv_end, BLOCK_N):
        pos = block + tl.arange(0, BLOCK_N)
        pos_mask = pos < kv_end
        page = tl.load(table_ptr + req * stride_tb + pos // PAGE_SIZE, mask=pos_mask, other=0)
        kv_offs = (page * PAGE_SIZE + pos % PAGE_SIZE)[:, None] * stride_ks
        kv_offs += (head // GROUP) * stride_kh + dims[None, :]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if DOT_FP32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        else:
            scores = tl.dot(q, tl.trans(k)) * sm_scale
        if HAS_CAP:
            scores = soft_cap(scores, logit_cap)
        key_pos = pos
        if HAS_TREE:
            new = pos - prefix_len  # index among the new tokens
            in_new = pos_mask & (new >= 0)
            depth = tl.load(depth_ptr + q_start + new, mask=in_new, other=0)
            key_pos = tl.where(in_new, prefix_len + depth, pos)
        allowed = (key_pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        if window > 0:
            allowed = allowed & (key_pos[None, :] > q_pos[:, None] - window)
        if HAS_TREE:
            tree_offs = tree_off + rows[:, None] * extend_len + new[None, :]
            in_tree = tree_rows[:, None] & in_new[None, :]
            allowed = allowed & (tl.load(tree_mask_ptr + tree_offs, mask=in_tree, other=1) != 0)
        scores = tl.where(allowed, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offs = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offs, out, mask=row_mask[:, None] & dim_mask[None, :])


@dataclass
class TreeMasks:
    """Draft trees of an extend batch, flattened for the kernel."""

    masks: torch.Tensor  # [sum of E * E] uint8: each tree request's [E, E] ancestor mask
    offsets: torch.Tensor  # [num_reqs] int64: where a request's mask starts; -1: none
    depths: torch.Tensor  # [num_tokens] int64: each new token's position - its prefix_len

    @classmethod
    def build(
        cls, masks: dict[int, torch.Tensor], extend_lens: list[int], device: torch.device
    ) -> TreeMasks:
        """From request index -> [extend_len, extend_len] bool ancestor mask (True: attend;
        a node's ancestors and itself, as ForwardBatch.tree_masks)."""
        offsets, flat, depths, at = [], [], [], 0
        for i, ext in enumerate(extend_lens):
            mask = masks.get(i)
            if mask is None:
                offsets.append(-1)
                depths.append(torch.arange(ext, device=device))
                continue
            offsets.append(at)
            flat.append(mask.reshape(-1).to(device, torch.uint8))
            depths.append(mask.sum(dim=1).to(device, torch.int64) - 1)
            at += ext * ext
        return cls(
            torch.cat(flat) if flat else torch.zeros(1, dtype=torch.uint8, device=device),
            torch.tensor(offsets, dtype=torch.int64, device=device),
            torch.cat(depths).to(torch.int64),
        )


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    max_extend_len: int,
    page_size: int,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    trees: TreeMasks | None = None,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every request's new tokens over its paged context (`trees`: draft
    trees' ancestor masks; `logit_cap`: soft-capped scores)."""
    num_tokens, num_heads, head_dim = q.shape
    block_m, block_n = 16, 32
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    grid = (len(extend_lens), num_heads, triton.cdiv(max_extend_len, block_m))
    dot_fp32 = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, q_starts, prefix_lens, extend_lens,
        *((q_starts,) * 3 if trees is None else (trees.masks, trees.offsets, trees.depths)),
        head_dim**-0.5 if sm_scale is None else sm_scale, sliding_window or 0, logit_cap or 0.0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0),
        GROUP=num_heads // k_cache.shape[1], PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_FP32=dot_fp32, HAS_TREE=trees is not None, HAS_CAP=logit_cap is not None,
    )  # fmt: skip
    return out.to(q.dtype)
