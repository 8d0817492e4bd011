"""Fp8Linear: float8_e4m3fn weights with per-output-channel scales (CUDA, torch._scaled_mm)."""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model.quant.base_linear import QuantizedLinear, bias_of

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Fp8Linear(QuantizedLinear):
    """float8_e4m3fn weights with per-output-channel scales; each token's activations are
    scaled to fp8 on the fly (per-row scales), so both operands feed `torch._scaled_mm`."""

    def __init__(
        self,
        qweight: torch.Tensor,  # [out, in] float8_e4m3fn
        scales: torch.Tensor,  # [out] fp32
        bias: torch.Tensor | None = None,
    ):
        out_features, in_features = qweight.shape
        super().__init__(in_features, out_features, bias)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.float().reshape(1, out_features))

    @classmethod
    def from_float(cls, linear: nn.Linear, absmax: torch.Tensor | None = None) -> Fp8Linear:
        """Each row scaled by its largest |weight| (`absmax` given: the whole layer's, for a
        row-parallel shard under tensor parallelism, quant/quantize.py)."""
        weight = linear.weight.detach().float()
        absmax = weight.abs().amax(dim=1) if absmax is None else absmax.float()
        scales = absmax.clamp(min=1e-12) / FP8_MAX
        qweight = (weight / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(qweight, scales, bias_of(linear))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        x_scales = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        x_fp8 = (x.float() / x_scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(
            x_fp8, self.qweight.t(), scale_a=x_scales, scale_b=self.scales, out_dtype=x.dtype
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.qweight.float() * self.scales.t()).to(dtype or torch.float32)
