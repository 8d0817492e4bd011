"""Plain-torch references for the Triton kernels; the kernel tests compare against these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float | None = None,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """One query per request over its pages, request by request, in fp32."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        pos = torch.arange(seq_len, device=q.device)
        slots = page_table[i, pos // page_size] * page_size + pos % page_size
        k = k_cache[slots].float().transpose(0, 1)  # [kv_heads, len, dim]
        v = v_cache[slots].float().transpose(0, 1)
        o = _attention(q[i].float()[:, None, :], k, v, None, sm_scale, logit_cap)
        out[i] = o[:, 0, :]
    return out.to(q.dtype)


def store_kv_ref(k, v, k_cache, v_cache, slots) -> None:
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def paged_extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    sliding_window: int | None = None,
    tree_masks: dict[int, torch.Tensor] | None = None,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """Each request's new tokens over its whole paged context, causal, in fp32.
    `tree_masks`: request -> [extend, extend] bool ancestor mask of a draft tree (its new
    tokens at prefix + depth, depth = ancestors in the mask, and seeing only those)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens)):
        pos = torch.arange(prefix + extend, device=q.device)
        slots = page_table[i, pos // page_size] * page_size + pos % page_size
        tree = (tree_masks or {}).get(i)
        if tree is not None:
            pos = torch.cat([pos[:prefix], prefix + tree.to(q.device).sum(dim=1) - 1])
        q_pos = pos[prefix:, None]
        mask = pos[None, :] <= q_pos
        if tree is not None:
            mask[:, prefix:] &= tree.to(q.device)
        if sliding_window:
            mask &= pos[None, :] > q_pos - sliding_window
        o = _attention(
            q[start : start + extend].float().transpose(0, 1),
            k_cache[slots].float().transpose(0, 1),
            v_cache[slots].float().transpose(0, 1),
            mask,
            None,
            logit_cap,
        )
        out[start : start + extend] = o.transpose(0, 1)
        start += extend
    return out.to(q.dtype)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    logit_cap: float | None,
) -> torch.Tensor:
    """q [heads, n, dim] over k, v [kv_heads, len, dim] (GQA); `logit_cap`: scaled scores ->
    cap * tanh(score / cap) before the mask and softmax (SDPA has no such option)."""
    if logit_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / logit_cap) * logit_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def int4_matmul_ref(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """x @ W.T with W = (codes - 8) * scale + zero; codes [N, K] in 0..15, scales and zeros
    [N, K // group_size]; dequantized and multiplied in fp32."""
    scale = scales.float().repeat_interleave(group_size, dim=1)
    zero = zeros.float().repeat_interleave(group_size, dim=1)
    weight = (codes.float() - 8) * scale + zero
    return (x.float() @ weight.t()).to(x.dtype)


def int8_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int | None = None,
) -> torch.Tensor:
    """x @ W.T with W = q * scale; scales [N] (per channel) or [N, K // group_size]; in fp32."""
    scale = scales.float()
    scale = scale[:, None] if group_size is None else scale.repeat_interleave(group_size, dim=1)
    return (x.float() @ (qweight.float() * scale).t()).to(x.dtype)


def segmented_lora_ref(
    out: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    slots: torch.Tensor,
    ranks: torch.Tensor,
    at: torch.Tensor,
    bt: torch.Tensor,
) -> torch.Tensor:
    """out with out[rows of segment s] += (x[rows] @ at[slot]) @ bt[slot] (ranks[slot] of
    them), segment by segment, in fp32; a new tensor."""
    result = out.float().clone()
    bounds = offsets.tolist()
    for s, slot in enumerate(slots.tolist()):
        rank = int(ranks[slot]) if slot < len(ranks) else 0
        seg_rows = rows[bounds[s] : bounds[s + 1]]
        if rank and len(seg_rows):
            shrunk = x[seg_rows].float() @ at[slot, :, :rank].float()
            result[seg_rows] += shrunk @ bt[slot, :rank].float()
    return result.to(out.dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """Token by token, in fp32: the sum over its experts among the local ones of
    weight * down(silu(gate) * up)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for weight, expert in zip(weights[t].tolist(), experts[t].tolist()):
            local = expert - first_expert
            if 0 <= local < w13.shape[0]:
                gate, up = (w13[local].float() @ x[t].float()).chunk(2)
                out[t] += weight * (w2[local].float() @ (F.silu(gate) * up))
    return out.to(x.dtype)
