"""KV store in Triton: write each new token's K and V into its pool slot.

k, v: [num_tokens, kv_heads, head_dim]    slots: [num_tokens]
k_cache, v_cache: [num_slots, kv_heads, head_dim]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, row_size,
    stride_k, stride_v, stride_kc, stride_vc, BLOCK: tl.constexpr,
):  # fmt: skip
    token, block = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
    tl.store(k_cache_ptr + slot * stride_kc + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block: int = 256,
) -> None:
    """k_cache[slots] = k and v_cache[slots] = v, in place (rows must be contiguous)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    row_size = k.shape[1] * k.shape[2]
    k, v = k.reshape(num_tokens, row_size), v.reshape(num_tokens, row_size)
    grid = (num_tokens, triton.cdiv(row_size, block))
    _kv_store_kernel[grid](
        k, v, k_cache, v_cache, slots, row_size,
        k.stride(0), v.stride(0), k_cache.stride(0), v_cache.stride(0), BLOCK=block,
    )  # fmt: skip
