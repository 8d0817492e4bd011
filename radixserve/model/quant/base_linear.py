"""The two layers every weight format builds on: UnquantizedLinear (the fp layer, what every
projection is before quantize-on-load replaces it) and QuantizedLinear (shape bookkeeping, the
forward that casts to the kernel's dtype, and the dense-matmul fallback for many rows).
The formats themselves: linear.py (int8, int4), fp8_linear.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model.quant.dense_panels import DequantizeInto, panel_matmul

DEQUANT_MIN_ROWS = 128  # from this many rows on, dequantize + dense matmul beats the kernels


class UnquantizedLinear(nn.Linear):
    """The fp layer: what every projection is before quantize-on-load replaces it."""

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.weight if dtype is None else self.weight.to(dtype)


class QuantizedLinear(nn.Module):
    """Common shape bookkeeping; subclasses keep their weights as buffers, not parameters.
    `dequant_min_rows`: from this many rows on, int8 / int4 layers dequantize and run one
    dense matmul; None keeps them on the kernels (--enable-deterministic-inference).
    `dense_dtype`: that matmul's dtype (None: the input's); the block kernels' layers, which
    compute in fp32 on any input, get the int layers' dtype here (bf16 on CPU by default: a
    prefill chunk's matmul is several times faster in bf16).
    `int8_activations`: the GGUF block layers' kernel quantizes activations to int8 blocks and
    uses integer dots (q8_matmul.py) instead of fp32 FMAs; set by activation_choice.py."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", bias)
        self.dequant_min_rows: int | None = DEQUANT_MIN_ROWS
        self.dense_dtype: torch.dtype | None = None
        self.int8_activations = False
        self._shared_dense: torch.Tensor | None = None

    def share_dense_weight(self, weight: torch.Tensor, min_rows: int) -> None:
        """From `min_rows` rows on, multiply by `weight` (an fp tensor holding this layer's
        weight exactly, e.g. the embedding a tied head is quantized from) instead of
        dequantizing. A plain attribute: the owner keeps it, nothing is copied."""
        self._shared_dense, self.dequant_min_rows = weight, min_rows

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T as one dense matmul: by the shared weight in its own dtype, else by the
        dequantized weight in dense_dtype; the result in x's dtype."""
        if self._shared_dense is not None:
            return F.linear(x.to(self._shared_dense.dtype), self._shared_dense).to(x.dtype)
        dtype = self.dense_dtype or x.dtype
        panels = self._panel_source() if dtype in (torch.float32, torch.bfloat16) else None
        if panels is not None:  # the C++ block kernels' layers: panel by panel
            dequantize_into, row_order = panels
            out = panel_matmul(x, self.out_features, dequantize_into, dtype)
            out = out if row_order is None else out.index_select(1, row_order)
            return out.to(x.dtype)
        return F.linear(x.to(dtype), self.dequantize(dtype)).to(x.dtype)

    def _panel_source(self) -> tuple[DequantizeInto, torch.Tensor | None] | None:
        """How to dequantize weight rows into a buffer (a C++ op of the block kernels) and
        the output order of those rows (None: as stored); None where the layer has no such
        op and its dense matmul dequantizes the whole weight."""
        return None

    def _dequantizes(self, x: torch.Tensor) -> bool:
        return self.dequant_min_rows is not None and x.shape[0] >= self.dequant_min_rows

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The activation dtype the kernel runs in (its scales' dtype); None: the input's.
        Inputs are cast to it and outputs back, so an fp32 model can run bf16 kernels."""
        return None

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Makes the kernel run in `dtype` (its scales are cast; codes are unchanged)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Runs ~120 times a decode step: one dtype lookup, buffers read from their dict
        # (nn.Module.__getattr__ costs ~1 us a read), no reshape of the model's 2-D rows.
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        dtype = self.compute_dtype
        out = self._matmul(rows if dtype is None else rows.to(dtype)).to(x.dtype)
        bias = self._buffers["bias"]
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # [m, in] -> [m, out]
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight this layer multiplies by, computed in `dtype` (default: its scales'
        dtype; float32 gives the kernels' effective weight exactly)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def bias_of(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().clone()


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> UnquantizedLinear:
    """An UnquantizedLinear around existing tensors (no copy, no init)."""
    with torch.device("meta"):
        linear = UnquantizedLinear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def fixed_dense_layer(weight: torch.Tensor) -> UnquantizedLinear:
    """A dense layer whose weight is a buffer, as a quantized layer's are: `load_weights`
    fills and checks parameters only, so this one is complete as built."""
    layer = dense_linear(weight)
    del layer.weight
    layer.register_buffer("weight", weight)
    return layer
