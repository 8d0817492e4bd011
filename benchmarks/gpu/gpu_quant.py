"""The quantized-matmul part of the GPU check: our Triton int4 / int8 dequant-GEMMs
(radixserve_kernels.quant_matmul) against their torch references, timed beside a plain
matmul in the model dtype and beside torch's own per-channel int8 kernel, at decode (M=1)
and prefill M, for each weight shape.

    row key: "<case> <out>x<in> m<M>"   ms, dense_ms (F.linear, model dtype), x_dense
    (dense_ms / ms: > 1 is faster than the unquantized matmul), weight_GBps (bytes of the
    quantized weight and its scales / time), rel_err (max |got - ref| / max |ref|)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

INT4_GROUP = 128  # the usual GPTQ / AWQ group
INT8_GROUP = 32  # GGUF Q8_0's block


class Case(NamedTuple):
    """One quantized matmul: the kernel, its reference, and the bytes of weight it reads."""

    run: Callable[[torch.Tensor], torch.Tensor]
    ref: Callable[[torch.Tensor], torch.Tensor]
    weight_bytes: int


def quant_matmul_rows(
    weights: Sequence[tuple[int, int]],
    ms: Sequence[int],
    device: str,
    dtype: torch.dtype,
    timed: Callable[[Callable[[], object]], float],
) -> dict[str, dict]:
    """Every case at every (out, in) weight shape and every M; `timed(fn)` -> seconds."""
    out = {}
    for n, k in weights:
        weight = torch.randn(n, k, device=device) / k**0.5
        dense = weight.to(dtype)
        cases = quant_cases(weight, dtype)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=dtype)
            dense_s = timed(lambda x=x, dense=dense: F.linear(x, dense))
            for name, case in cases.items():
                out[f"{name} {n}x{k} m{m}"] = _measure(case, x, dense_s, timed)
    return out


def quant_cases(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, Case]:
    """int4 g128 and int8 g32 / per channel on Triton, and torch's per-channel int8."""
    from radixserve.model.quant.linear import quantize_int4
    from radixserve_kernels import quant_matmul as qm
    from radixserve_kernels import reference as ref

    codes, scales, zeros = quantize_int4(weight, INT4_GROUP)
    packed, s4, z4 = qm.pack_int4(codes), _t(scales, dtype), _t(zeros, dtype)
    q8g, s8g = _int8(weight, INT8_GROUP)
    q8, s8 = _int8(weight, None)
    s8g_t, s8 = _t(s8g, dtype), s8.to(dtype)
    int8_mm = torch.ops.aten._weight_int8pack_mm
    return {
        "int4 g128": Case(
            lambda x: qm.int4_matmul(x, packed, s4, z4, INT4_GROUP),
            lambda x: ref.int4_matmul_ref(x, codes, s4.t(), z4.t(), INT4_GROUP),
            _nbytes(packed, s4, z4),
        ),
        "int8 g32": Case(
            lambda x: qm.int8_matmul(x, q8g, s8g_t, INT8_GROUP),
            lambda x: ref.int8_matmul_ref(x, q8g, s8g_t.t(), INT8_GROUP),
            _nbytes(q8g, s8g_t),
        ),
        "int8 per-channel": Case(
            lambda x: qm.int8_matmul(x, q8, s8),
            lambda x: ref.int8_matmul_ref(x, q8, s8),
            _nbytes(q8, s8),
        ),
        "torch int8 per-channel": Case(
            lambda x: int8_mm(x, q8, s8), lambda x: ref.int8_matmul_ref(x, q8, s8), _nbytes(q8, s8)
        ),
    }


def _t(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, groups] -> the kernels' [groups, out], in the activation dtype."""
    return t.t().to(dtype).contiguous()


def _int8(weight: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: scales [out] (group None) or [out, in // group]."""
    n, k = weight.shape
    grouped = weight.reshape(n, k // (group or k), group or k)
    scales = grouped.abs().amax(dim=-1).clamp(min=1e-8) / 127
    q = torch.round(grouped / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), scales if group else scales[:, 0]


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(case: Case, x: torch.Tensor, dense_s: float, timed) -> dict:
    want = case.ref(x).float()
    err = (case.run(x).float() - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
    seconds = timed(lambda: case.run(x))
    return {
        "ms": seconds * 1e3,
        "dense_ms": dense_s * 1e3,
        "x_dense": dense_s / seconds,
        "weight_GBps": case.weight_bytes / seconds / 1e9,
        "rel_err": err,
    }
