"""Prefill's dense matmul over a block-quantized weight on CPU, panel by panel.

A layer on the C++ block kernels (GGUF blocks, K-quants) runs a prefill chunk as one dense
GEMM on its dequantized weight (from `dequant_min_rows` rows on). Dequantizing the whole
weight per call costs fresh pages every time: a 2048 x 8192 fp32 weight is 64 MiB, and its
page faults alone take longer on one core than the dequantization (measured: 40 ms to
allocate and fill it, 8.5 ms to fill a reused one). So the weight goes through in panels of
at most PANEL_BYTES: each panel of rows is dequantized by the C++ op (the kernels' own fp32
values) into one buffer the thread keeps, and torch's GEMM writes that panel's output columns.
In bf16 (`dense_dtype` bf16, where a bf16 GEMM measures faster) the C++ op writes the panel
in bf16 itself (each fp32 value rounded to nearest even, as `.to(torch.bfloat16)` rounds),
into a kept bf16 buffer: the values the fp32 panel cast to bf16 gives, without writing the
fp32 panel and reading it again (1B Q4_0, 256-token prefill: dequantize, unpack and cast
took a quarter of the time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

PANEL_BYTES = 16 << 20  # fp32 weight rows per panel: at most this many bytes

DequantizeInto = Callable[[int, torch.Tensor], None]
"""(row0, out [rows, K] fp32 or bf16): writes weight rows row0 .. row0 + rows into out."""

_local = threading.local()


def _scratch(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [rows, cols] view of this thread's panel buffer of `dtype` (grown, never shrunk); a
    normal tensor even when made under inference mode, so that a later call outside it may
    still copy into it."""
    name = f"buf_{dtype}"
    buf = getattr(_local, name, None)
    if buf is None or buf.numel() < rows * cols:
        with torch.inference_mode(False):
            buf = torch.empty(rows * cols, dtype=dtype)
        setattr(_local, name, buf)
    return buf[: rows * cols].view(rows, cols)


def panel_rows(out_features: int, in_features: int) -> int:
    """Weight rows per panel: as many as PANEL_BYTES holds, a multiple of 16, at least 16."""
    rows = max(16, PANEL_BYTES // (4 * in_features) // 16 * 16)
    return min(rows, out_features)


def panel_matmul(
    x: torch.Tensor,
    out_features: int,
    dequantize_into: DequantizeInto,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, out_features] in `dtype` (float32 or bfloat16: x and each panel
    rounded to it), W dequantized panel by panel."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"panel_matmul: dtype must be float32 or bfloat16; got {dtype}")
    x = x.to(dtype).contiguous()
    out = x.new_empty(x.shape[0], out_features)
    step = panel_rows(out_features, x.shape[1])
    for row0 in range(0, out_features, step):
        rows = min(step, out_features - row0)
        weight = _scratch(rows, x.shape[1], dtype)
        dequantize_into(row0, weight)
        torch.mm(x, weight.t(), out=out[:, row0 : row0 + rows])
    return out
