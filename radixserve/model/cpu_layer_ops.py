"""Fused C++ CPU ops for the small-op clusters of a Llama layer (native/csrc/layer_ops.cpp).

An eager CPU decode step spent ~9 ms of a 30-layer step in small torch ops (RMSNorm's five,
RoPE's chunk/cat/neg/mul, the K/V write, SiLU * mul, residual adds) and more in the Python
around them (docs/performance.md, "Where a CPU decode step goes"). These ops do each cluster
in one call, row by row (batch-invariant), rounding where the torch reference rounds:

    rms_norm       RMSNorm
    add_rms_norm   residual += x; x = rms_norm(residual)          (in place; vLLM's contract)
    silu_mul       silu(gate) * up of the gate_up projection's output
    moe_grouped_experts   a routed MLP's fp32 experts over their sorted rows, one call
                   (native/csrc/moe_experts.cpp; model/moe.py decides when)
    rope_store     q_norm / k_norm (Qwen3), RoPE of q and k in place in the qkv output, and
                   k, v into their pool slots: what rotary + `KVPool.write` did

They are built into `torch.ops.radixserve_cpu` with the attention kernels (one extension,
one build, one cache key: native/extension.py). `LlamaForCausalLM.use_cpu_layer_ops`
hands them to the layers; without a compiler the layers keep the torch reference, and so do
steps traced by torch.compile (the reference is what inductor fuses).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixserve.native.extension import CpuExtensionUnavailable, load_cpu_ops

logger = logging.getLogger(__name__)

LAYER_OPS_DTYPES = (torch.float32, torch.bfloat16)
"""Activation and KV pool dtypes the ops take; other models keep the torch reference."""


class CpuLayerOps:
    """Typed, positional calls into the fused ops (each a few microseconds of dispatch)."""

    def __init__(self, ops: Any):
        self._rms_norm = ops.rms_norm.default
        self._add_rms_norm = ops.add_rms_norm.default
        self._silu_mul = ops.silu_mul.default
        self._rope_store = ops.rope_store.default
        self._moe_grouped_experts = ops.moe_grouped_experts.default

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of `x` (any leading dims), as a new tensor."""
        if x.dim() == 2:
            return self._rms_norm(x, weight, eps)
        return self._rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """x, residual: [rows, dim]; residual += x, then x = rms_norm(residual), in place."""
        self._add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] -> silu(gate) * up [rows, inter]."""
        return self._silu_mul(gate_up)

    def moe_grouped_experts(
        self, rows: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        """fp32 rows sorted by expert (expert e's: offsets[e] .. offsets[e + 1]) -> each row's
        expert output, every expert in one call (native/csrc/moe_experts.cpp)."""
        return self._moe_grouped_experts(rows, offsets, w13, w2)

    def rope_store(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        cos: torch.Tensor,  # [num_tokens, (1,) head_dim] fp32, contiguous
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],  # the layer's pool: [num_slots, kv_heads, dim]
        slots: torch.Tensor,  # [num_tokens] int64
        shape: tuple[int, int, int],  # num_heads, num_kv_heads, head_dim
        qk_norm: tuple[torch.Tensor, torch.Tensor] | None,
        eps: float,
    ) -> None:
        """Rotates q and k in place in `qkv` (after Qwen3's per-head norms, when given) and
        writes k and v into their pool slots."""
        q_norm, k_norm = qk_norm if qk_norm is not None else (None, None)
        self._rope_store(qkv, cos, sin, kv[0], kv[1], slots, *shape, q_norm, k_norm, eps)


def load_cpu_layer_ops() -> CpuLayerOps | None:
    """The fused ops, built or loaded; None (one log line) where the extension cannot build."""
    try:
        return CpuLayerOps(load_cpu_ops())
    except CpuExtensionUnavailable as exc:
        logger.info("fused CPU layer ops off, the torch reference runs: %s", exc)
        return None
