"""Fused mixture-of-experts in Triton: each expert's routed rows as one grouped matmul.

The (token, k) assignments are sorted by expert and each expert's run padded to a multiple
of BLOCK_M (`align_by_expert`, SGLang's moe_align_block_size idea done with torch ops), so
a block of BLOCK_M sorted rows belongs to one expert; a program computes one block times a
BLOCK_N tile of that expert's weight, reading the activations through the sorted ids:

    assignments (t, k) --sort by local expert--> [e0 e0 e0 pad | e1 pad pad pad | ...]
    gate_up[a] = x[a // top_k] @ w13[e].T          (launch 1, a program per block x N tile)
    act        = silu(gate) * up                     (torch)
    rows[a]    = weight[a] * act[a] @ w2[e].T        (launch 2)
    out[t]     = sum over k of rows[t * top_k + k]

Experts outside [first_expert, first_expert + local) (expert parallelism: another rank's)
get no block; their rows stay zero. Nothing reads a count on the host, so the whole path
runs inside a CUDA graph capture. fp32 dots are exact-product (ieee); 16-bit activations
dot in their dtype, accumulating in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, weight_ptr, num_assign, N, K, top_k,
    stride_a, stride_we, stride_wn, stride_o,
    PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # padding past the last expert's run, or no local expert
        return
    ids = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_assign
    a_rows = ids // top_k if PER_TOKEN else ids
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # fmt: skip
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    mask = valid[:, None] & n_mask[None, :]
    tl.store(out_ptr + ids[:, None] * stride_o + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def align_by_expert(
    experts: torch.Tensor, num_local: int, first_expert: int = 0, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, top_k] (global ids) -> (sorted_ids [capacity]: assignment index t * top_k
    + k grouped by local expert, each run padded with the sentinel T * top_k to a multiple
    of block_m; block_expert [capacity / block_m]: each block's local expert, -1 for none).
    The capacity is the worst case, T * top_k + num_local * (block_m - 1), so no count is
    read on the host."""
    device, num_assign = experts.device, experts.numel()
    flat = experts.reshape(-1) - first_expert
    key = torch.where((flat >= 0) & (flat < num_local), flat, num_local)  # others sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start, start = pad_end - padded, torch.cumsum(counts, 0) - counts
    capacity = triton.cdiv(num_assign + num_local * (block_m - 1), block_m) * block_m
    sorted_key = key[order]
    local = sorted_key.clamp(max=num_local - 1)
    dest = pad_start[local] + torch.arange(num_assign, device=device) - start[local]
    dest = torch.where(sorted_key < num_local, dest, capacity)  # non-local: a dump slot
    sorted_ids = torch.full((capacity + 1,), num_assign, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, dest, order)
    block_start = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1)
    return sorted_ids[:capacity], block_expert


def _grouped_gemm(a, w, out, sorted_ids, block_expert, weights, top_k, per_token):
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.shape[0], triton.cdiv(n, BLOCK_N))
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, weights, out.shape[0], n, k, top_k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        PER_TOKEN=per_token, MUL_WEIGHT=not per_token, DOT_FP32=a.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [local, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [local, hidden, inter]
    weights: torch.Tensor,  # [T, top_k] routing weights
    experts: torch.Tensor,  # [T, top_k] global expert ids
    first_expert: int = 0,
) -> torch.Tensor:
    """Sum over each token's experts among the local ones of weight * down(silu(gate(x)) *
    up(x)), every expert's rows one grouped matmul per projection."""
    num_tokens, top_k = experts.shape
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_ids, block_expert = align_by_expert(experts, w13.shape[0], first_expert)
    num_assign = num_tokens * top_k
    gate_up = torch.zeros(num_assign, w13.shape[1], dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).contiguous()
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_expert, flat_weights, top_k, True)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    rows = torch.zeros(num_assign, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, rows, sorted_ids, block_expert, flat_weights, top_k, False)
    return rows.view(num_tokens, top_k, -1).sum(dim=1)
