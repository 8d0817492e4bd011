"""Batch-invariant fp matmuls for --enable-deterministic-inference on CPU.

A row's result must not depend on how many rows share its matmul: a speculative verify
computes 2..K+1 rows where plain decoding computes 1, and a bf16 cast downstream (the int
kernels' inputs) turns a last-bit difference into a different token. What we found on CPU
(torch 2.13, MKL, 1 and 2 threads; `tests/test_batch_invariance.py` checks it):

    matmul                          row results by row count M
    F.linear(x, w)  (fp32)          M = 1 (gemv) | 2..15 | >= 16: three different roundings
    x @ W.T, W.T a contiguous copy  M = 1 (gemv) | every M >= 2 the same (also W @ x.T)
    int8 / int4 CPU kernels (bf16)  every M the same (row-wise kernels; the dequantize-for-
                                    prefill path is off under the flag)

So a BatchInvariantLinear keeps W.T as its own contiguous [in, out] copy, computes
`x @ W.T` and pads a lone row with a zero row: every row then takes the same gemm. Measured on
SmolLM2's 49152 x 576 head, 1 thread: 1 row 9 ms (gemv) -> 12 ms, 5 rows 21 -> 16 ms; `(W @
x.T).T` on the original weight (no copy) is as invariant but costs 28 ms at 1 row. The copy
replaces the weight of a projection or an untied head (same memory) and doubles a tied head's
(the embedding lookup keeps its own rows).

Attention has its own deterministic mode under the same flag: cpu_fused runs every query
through one extend kernel (radixserve/attention/cpu_fused.py).
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
        self.register_buffer("weight_t", weight.detach().t().contiguous())  # [in, out]
        self.register_buffer("bias", None if bias is None else bias.detach())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BatchInvariantLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        if num_rows == 1:  # a lone row would take the gemv, which rounds differently
            rows = torch.cat([rows, rows.new_zeros(1, self.in_features)])
        out = (rows @ self.weight_t)[:num_rows]  # [num_rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

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
        model.lm_head = BatchInvariantLinear(model.embed_tokens.weight)
        swapped += 1
    return swapped
