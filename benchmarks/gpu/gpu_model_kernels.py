"""The model-kernel part of the GPU check: the Triton kernels that MoE models, multi-LoRA,
draft-tree verification and Gemma's soft-capping run on CUDA, each against its torch
reference on the device (on CPU they are tested under the Triton interpreter only).

    fused_moe       Qwen3-30B-A3B's experts (128 of hidden 2048, inter 768, top 8), T tokens
    lora_segments   8 adapters of rank 16 and the base mixed in one batch, Llama-3-8B's q_proj
    extend_tree     a verify of 16-node draft trees (a chain and a fan) over a paged prefix
    extend_softcap  the extend kernel with Gemma's attn_logit_softcapping (50)

    row key: "<case>"   ms, rel_err (max |got - ref| / max |ref|), shape
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gpu_run import paged_kv


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _fused_moe(device: str, dtype: torch.dtype, smoke: bool, timed) -> dict:
    from radixserve_kernels.fused_moe import fused_moe
    from radixserve_kernels.reference import fused_moe_ref

    tokens, hidden, inter, experts, top_k = (4, 64, 32, 8, 2) if smoke else (64, 2048, 768, 128, 8)
    gen = torch.Generator(device=device).manual_seed(0)  # made on the device: 3 GB at full size

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = randn(tokens, hidden)
    w13, w2 = (
        randn(experts, 2 * inter, hidden, scale=hidden**-0.5),
        randn(experts, hidden, inter, scale=inter**-0.5),
    )
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights.to(dtype)
    run = lambda: fused_moe(x, w13, w2, weights, ids)  # noqa: E731
    return {
        "ms": timed(run) * 1e3,
        "rel_err": _rel_err(run(), fused_moe_ref(x, w13, w2, weights, ids)),
        "shape": f"{tokens} tokens x {experts} experts top {top_k}, {hidden} -> {inter}",
    }


def _lora_segments(device: str, dtype: torch.dtype, smoke: bool, timed) -> dict:
    from radixserve.forward_batch import LoraBatch
    from radixserve.model.lora_segments import stack_slots
    from radixserve_kernels.lora_segments import segmented_lora
    from radixserve_kernels.reference import segmented_lora_ref

    tokens, k, n, adapters, rank = (12, 64, 48, 3, 16) if smoke else (256, 4096, 4096, 8, 16)
    gen = torch.Generator(device="cpu").manual_seed(1)
    weights = {s: (torch.randn(rank, k, generator=gen) / k**0.5,
                   torch.randn(n, rank, generator=gen)) for s in range(adapters)}  # fmt: skip
    stacked = stack_slots(weights)
    at, bt = stacked.at.to(device, dtype), stacked.bt.to(device, dtype)
    ranks = stacked.ranks.to(device)
    slot_per_token = np.arange(tokens) % (adapters + 1) - 1  # -1: the base model's rows
    batch = LoraBatch.build(slot_per_token, device)
    longest = max(end - start for _, start, end in batch.segments)
    x = torch.randn(tokens, k, generator=gen).to(device, dtype)
    out = torch.randn(tokens, n, generator=gen).to(device, dtype)
    want = segmented_lora_ref(out, x, batch.rows, batch.offsets, batch.slot_ids, ranks, at, bt)

    def run() -> torch.Tensor:
        got = out.clone()
        segmented_lora(got, x, batch.rows, batch.offsets, batch.slot_ids, ranks, at, bt,
                       longest)  # fmt: skip
        return got

    return {
        "ms": timed(run) * 1e3,
        "rel_err": _rel_err(run() - out, want - out),  # the LoRA part alone
        "shape": f"{tokens} tokens, {adapters} adapters of rank {rank} + base, {k} -> {n}",
    }


def _paged_extend(
    device: str, dtype: torch.dtype, smoke: bool, timed, tree: bool, cap: float | None
) -> dict:
    from radixserve_kernels.paged_extend import TreeMasks, paged_extend_attention
    from radixserve_kernels.reference import paged_extend_attention_ref

    reqs, prefix, ext, ps = (2, 40, 16, 16) if smoke else (16, 2048, 16, 16)
    heads, kv_heads, dim = (4, 2, 64) if smoke else (32, 8, 128)
    table, k, v, _ = paged_kv(reqs, prefix + ext, ps, kv_heads, dim, device, dtype)
    q = torch.randn(reqs * ext, heads, dim, device=device, dtype=dtype)
    starts = torch.arange(reqs, device=device) * ext
    prefixes, extends = [prefix] * reqs, [ext] * reqs
    masks = None
    if tree:  # even requests: a chain (causal); odd: a fan (every node sees the root only)
        fan = torch.eye(ext, dtype=torch.bool)
        fan[:, 0] = True
        chain = torch.tril(torch.ones(ext, ext, dtype=torch.bool))
        masks = {i: chain if i % 2 == 0 else fan for i in range(reqs)}
    trees = TreeMasks.build(masks, extends, torch.device(device)) if tree else None
    run = lambda: paged_extend_attention(  # noqa: E731
        q, k, v, table, starts, torch.tensor(prefixes, device=device),
        torch.tensor(extends, device=device), ext, ps, trees=trees, logit_cap=cap)  # fmt: skip
    want = paged_extend_attention_ref(q, k, v, table, prefixes, extends, ps, tree_masks=masks,
                                      logit_cap=cap)  # fmt: skip
    return {
        "ms": timed(run) * 1e3,
        "rel_err": _rel_err(run(), want),
        "shape": f"{reqs} reqs x {ext} new over {prefix}, {heads}/{kv_heads} heads x {dim}",
    }


def model_kernel_rows(
    device: str, dtype: torch.dtype, smoke: bool, timed: Callable[[Callable[[], object]], float]
) -> dict[str, dict]:
    """Every case; a case that raises is recorded as its error, the others still run."""
    cases = {
        "fused_moe": lambda: _fused_moe(device, dtype, smoke, timed),
        "lora_segments": lambda: _lora_segments(device, dtype, smoke, timed),
        "extend_tree": lambda: _paged_extend(device, dtype, smoke, timed, True, None),
        "extend_softcap": lambda: _paged_extend(device, dtype, smoke, timed, False, 50.0),
    }
    rows = {}
    for name, case in cases.items():
        try:
            rows[name] = case()
        except Exception as exc:  # noqa: BLE001 (one broken kernel must not hide the others)
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return rows
