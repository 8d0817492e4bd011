"""Batch-invariant fp matmuls for --enable-deterministic-inference on CPU.

A row's result must not depend on how many rows share its matmul: a speculative verify
computes 2..K+1 rows where plain decoding computes 1, and a bf16 cast downstream (the int
kernels' inputs) turns a last-bit difference into a different token. What we found on CPU
(torch 2.13, MKL, 1 and 2 threads; `tests/test_batch_invariance.py` checks it):

    matmul                          row results by row count M
    F.linear(x, w)  (fp32)          M = 1 (gemv) | 2..15 | >= 16: three different roundings
    w @ x.T         (fp32)          M = 1 (gemv) | every M >= 2 the same
    int8 / int4 CPU kernels (bf16)  every M the same (row-wise kernels; the dequantize-for-
                                    prefill path is off under the flag)

So a BatchInvariantLinear computes `(w @ x.T).T` and pads a lone row with a zero row, which
puts every row on the same gemm arithmetic. The cost is a 2-row gemm where a gemv would do
(docs/performance.md); prefill-sized batches run the same gemm as before.

Attention is not covered here: decode and short extends (cpu_fused's kernel) round
differently from SDPA over longer extends (radixserve/attention/).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model.quant.linear import UnquantizedLinear


class BatchInvariantLinear(nn.Module):
    """x @ W.T + b with the same arithmetic for a row whatever the number of rows (CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.weight.requires_grad_(False)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BatchInvariantLinear:
        """Shares `linear`'s weight and bias (no copy)."""
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        if num_rows == 1:  # a lone row would take the gemv, which rounds differently
            rows = torch.cat([rows, rows.new_zeros(1, self.in_features)])
        # [num_rows, out], row-major again: reductions downstream (RMSNorm) vectorize by layout
        out = (self.weight @ rows.t()).t()[:num_rows].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def make_fp_layers_batch_invariant(model: nn.Module) -> int:
    """Swaps every UnquantizedLinear (fp projections, the LM head; a tied head gets one that
    shares the embedding's weight) for a BatchInvariantLinear; returns how many."""
    swapped = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, UnquantizedLinear):
                setattr(owner, name, BatchInvariantLinear.from_linear(child))
                swapped += 1
    if getattr(model, "lm_head", False) is None:  # tied: the embedding is the head
        model.lm_head = BatchInvariantLinear(model.embed_tokens.weight)
        swapped += 1
    return swapped
