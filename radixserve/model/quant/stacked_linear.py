"""One fused projection whose parts are stored in different formats.

llama.cpp's mixes give the parts of one of our fused layers different types: a Q4_K_M file
stores attn_q / attn_k as Q4_K and, in some layers, attn_v as Q6_K. `StackedLinear` keeps
each run of same-format parts as its own layer and concatenates their outputs along the
features, so every part keeps its blocks and its kernel:

    x ──> [q, k: Q4_K layer] ──┐
      └─> [v:    Q6_K layer] ──┴──> cat(-1) = qkv
"""

from __future__ import annotations

import torch
from torch import nn


class StackedLinear(nn.Module):
    """Parts stacked by output rows: forward(x) = cat([part(x) for part in parts], -1)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        if len({part.in_features for part in parts}) != 1:
            raise ValueError("StackedLinear: every part must take the same in_features")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stacked weight [out, in] the parts multiply by."""
        return torch.cat([part.dequantize(dtype).to(dtype or torch.float32) for part in self.parts])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
