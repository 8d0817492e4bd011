"""Batch-invariant dense layers for --enable-deterministic-inference on CPU.

A row's result must not depend on how many rows share its matmul: a speculative verify
computes 2..K+1 rows where plain decoding computes 1, and a last-bit difference can become a
different token. No BLAS promises that (MKL's `x @ W.T` happened to round every M >= 2 alike
on an Intel Xeon and not on an AMD EPYC), so these layers run our own kernel
(native/csrc/dense_matmul.cpp): every output is one fixed-order fp32 FMA chain over the input
dimension, whatever the row count, thread count or SIMD level, for fp32 and bf16 activations
and weights. Threads split the output features, so one row still uses every thread.

    weight [N, K] -> packed [Np / 16, K, 16] in the weight's dtype (Np: N padded to 64)

The packed copy replaces the weight of a projection or an untied head (same memory, plus the
padding) and adds one beside a tied head's embedding (the lookup keeps its own rows). Without
the C++ kernels the layer runs each row as its own one-row matmul (the same call, so the same
arithmetic, at any batch: slow for prefill), and says so once in the log.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.quant.linear import UnquantizedLinear

logger = logging.getLogger(__name__)

PANEL = 16  # output features per packed panel (dense_matmul.cpp's kPanel)
GROUP = 64  # output features per work item: N is padded to a multiple of it


@functools.cache
def dense_kernels() -> Any | None:
    """`torch.ops.radixserve_cpu` with its dense_mm, or None (logged) where it cannot build."""
    from radixserve.native.extension import CpuExtensionUnavailable, load_cpu_ops

    try:
        ops = load_cpu_ops()
    except CpuExtensionUnavailable as exc:
        logger.warning(
            "batch-invariant dense kernel unavailable (%s); deterministic layers run each row "
            "as its own matmul (slow prefill)",
            str(exc).splitlines()[0],
        )
        return None
    torch.library.register_fake("radixserve_cpu::dense_mm")(_dense_mm_fake)
    return ops


def _dense_mm_fake(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


def pack_dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [Np / 16, K, 16] (zero rows pad N to Np, a multiple of 64), same dtype."""
    n, k = weight.shape
    padded = -(-n // GROUP) * GROUP
    weight = F.pad(weight.detach(), (0, 0, 0, padded - n))
    return weight.reshape(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


def unpack_dense_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of pack_dense_weight: [Np / 16, K, 16] -> [N, K]."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:out_features]


def dense_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """[M, K] fp32 / bf16 @ W.T (W packed) -> [M, N] fp32, batch-invariant per row."""
    return torch.ops.radixserve_cpu.dense_mm(x.contiguous(), packed, out_features)


class BatchInvariantLinear(nn.Module):
    """x @ W.T + b with the same arithmetic for a row whatever the number of rows (CPU):
    fp32 accumulation, the bias added in fp32, one rounding to x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", pack_dense_weight(weight))
        self.register_buffer("bias", None if bias is None else bias.detach())
        self._kernel = dense_kernels() is not None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BatchInvariantLinear:
        return cls(linear.weight, linear.bias)

    def weight(self) -> torch.Tensor:
        """The layer's [out, in] weight (a view of the packed copy, without its padding)."""
        return unpack_dense_weight(self.packed_weight, self.out_features)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as floats, as the other linear layers give it (e.g. an EAGLE3 head
        borrowing the target's LM head)."""
        weight = self.weight()
        return weight if dtype is None else weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._kernel:
            out = dense_matmul(rows, self.packed_weight, self.out_features)
        else:
            out = self._one_row_at_a_time(rows)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _one_row_at_a_time(self, rows: torch.Tensor) -> torch.Tensor:
        """The fallback: every row as the same one-row fp32 matmul, so any batch rounds alike."""
        weight = self.weight().float()
        return torch.cat([F.linear(row[None].float(), weight) for row in rows.unbind()])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def make_fp_layers_batch_invariant(model: nn.Module) -> int:
    """Swaps every UnquantizedLinear (fp projections, the LM head; a tied head gets its own
    from the embedding's weight) for a BatchInvariantLinear; returns how many."""
    swapped = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, UnquantizedLinear):
                setattr(owner, name, BatchInvariantLinear.from_linear(child))
                swapped += 1
    if getattr(model, "lm_head", False) is None:  # tied: the embedding is the head
        model.lm_head = BatchInvariantLinear(model.head_weight())
        swapped += 1
    return swapped
