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
) -> torch.Tensor:
    """One query per request over its pages, request by request, in fp32."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        pos = torch.arange(seq_len, device=q.device)
        slots = page_table[i, pos // page_size] * page_size + pos % page_size
        k = k_cache[slots].float().transpose(0, 1)  # [kv_heads, len, dim]
        v = v_cache[slots].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[i].float()[:, None, :], k, v, scale=sm_scale, enable_gqa=True
        )
        out[i] = o[:, 0, :]
    return out.to(q.dtype)


def store_kv_ref(k, v, k_cache, v_cache, slots) -> None:
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
