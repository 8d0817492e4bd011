"""The linear-layer seam: one class per weight format, each `forward(x) -> x @ W.T + b`.

    UnquantizedLinear       nn.Linear (fp32 / bf16 / fp16 weight)
    Int8WeightOnlyLinear    int8 [out, in] + one scale per output channel, or per group of
                            `group_size` input channels (a GGUF Q8_0 block); w = q * scale
    Int4WeightOnlyLinear    4-bit codes q + one scale and one zero per group of `group_size`
                            input channels; w = (q - 8) * scale + zero
    Fp8Linear               float8_e4m3fn [out, in] + one scale per output channel; activations
                            are cast to fp8 per token at run time (torch._scaled_mm)

Activations stay in the model dtype (weight-only for int8/int4). Which kernel runs, by the
device the weights are built on (`matmul_backend`); a layer's storage is that kernel's
layout, so a layer is built on its device and never moved:

    layer                device  kernel                              int4 / int8 storage
    int8, per channel    any     torch `_weight_int8pack_mm`         [out, in] int8
    int8, group-wise     CPU     `_weight_int8pack_mm` per group     [groups, out, group]
                         CUDA    Triton `int8_matmul`                [out, in] int8
    int4                 CPU     torch `_weight_int4pack_mm_for_cpu` torch's CPU packing
                         CUDA    Triton `int4_matmul`                [out, in / 2] uint8
    int4 / int8, 32-wide CPU     C++ block kernels (backend          GGUF-style blocks
    groups (GGUF)                "blocks", block_matmul.py)          (block_matmul.py)
    fp8                  CUDA    torch `_scaled_mm`

torch's own CUDA int4 kernel (`_weight_int4pack_mm`) takes bf16 only; the Triton kernels
(radixserve_kernels.quant_matmul) take fp32 / fp16 / bf16 and any out_features.
`dequantize()` gives back the weight each layer multiplies by, for tests and for the fp
reference path. This module holds the int8 and int4 layers and picks their kernels; the fp
layer and the QuantizedLinear base are in base_linear.py, Fp8Linear in fp8_linear.py, and
every layer is importable from here.

torch's int8 / int4 CPU kernels are matrix-vector kernels: their time grows linearly with the rows
(the "blocks" kernels too), so past `dequant_min_rows` rows (a prefill chunk) the torch-backend
layers dequantize the weight once and run one dense matmul, several times faster (measured: 576x3072
int4 at 512 rows, 23 ms in the kernel vs ~10 ms dequantize + matmul). Decode batches stay on the
kernels, which read 2-4x fewer bytes. --enable-deterministic-inference keeps every batch on them.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from radixserve.model.quant import block_matmul, q8_matmul
from radixserve.model.quant.base_linear import (
    DEQUANT_MIN_ROWS,
    QuantizedLinear,
    UnquantizedLinear,
    bias_of,
    dense_linear,
)
from radixserve.model.quant.dense_panels import DequantizeInto
from radixserve.model.quant.fp8_linear import FP8_MAX, Fp8Linear
from radixserve.model.quant.int4_layout import packing_format, unpack_codes

INT4_GROUP_SIZES = (32, 64, 128)  # torch's CPU int4 kernel also takes 256; we offer these
INT4_OUT_MULTIPLE = 16  # the CPU int4 packer needs out_features divisible by 16
INT4_MID = 8  # torch's int4 kernels read code q as (q - 8) * scale + zero
MATMUL_BACKENDS = ("torch", "triton", "blocks")
_INT4_MM_CPU = torch.ops.aten._weight_int4pack_mm_for_cpu.default


class Int8WeightOnlyLinear(QuantizedLinear):
    """int8 weights, fp activations. Per-channel scales run as one `_weight_int8pack_mm`
    (torch has it on CPU and CUDA; backend="triton" runs ours instead). Group-wise scales
    (GGUF Q8_0): on CUDA the Triton kernel; on CPU one `_weight_int8pack_mm` per group,
    summed: exact, but slower; or, 32-wide groups, the C++ block kernel (backend "blocks")."""

    def __init__(
        self,
        qweight: torch.Tensor,  # [out, in] int8
        scales: torch.Tensor,  # [out] (per channel) or [out, in // group_size], activation dtype
        bias: torch.Tensor | None = None,
        group_size: int | None = None,
        *,
        backend: str | None = None,  # "torch" | "triton"; None: per channel "torch",
        # group-wise matmul_backend(device)
    ):
        out_features, in_features = qweight.shape
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        per_channel_default = backend is None and group_size is None
        self.backend = "torch" if per_channel_default else _backend(backend, qweight.device)
        _check_blocks(self.backend, group_size, "Int8WeightOnlyLinear")
        if self.backend == "blocks":  # the block kernel's scales are fp32 whatever the model's
            scales = scales.float()
        if group_size is None or self.backend in ("triton", "blocks"):
            self.register_buffer("qweight", qweight.contiguous())  # [out, in]
        else:  # [groups, out, group_size]: each group's slice contiguous
            num_groups = in_features // group_size
            grouped = qweight.reshape(out_features, num_groups, group_size).transpose(0, 1)
            self.register_buffer("qweight", grouped.contiguous())
        scales = scales if group_size is None or self.backend == "blocks" else scales.t()
        self.register_buffer("scales", scales.contiguous())  # [out], [groups, out] or
        # [out, groups] ("blocks")

    @classmethod
    def from_float(
        cls, linear: nn.Linear, absmax: torch.Tensor | None = None
    ) -> Int8WeightOnlyLinear:
        """Symmetric per-output-channel quantization: scale = max|w| / 127; `absmax`: each
        row's max|w| over the whole row, where `linear` holds a part of its columns (a
        row-parallel shard; default: its own)."""
        weight = linear.weight.detach().float()
        absmax = weight.abs().amax(dim=1) if absmax is None else absmax.float()
        scales = absmax.clamp(min=1e-8) / 127
        qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(qweight, scales.to(linear.weight.dtype), bias_of(linear))

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return None if self.backend == "blocks" else self._buffers["scales"].dtype

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        if self.backend == "blocks":
            raise ValueError("Int8WeightOnlyLinear: backend 'blocks' computes in fp32")
        self.scales = self.scales.to(dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "blocks" and not self._dequantizes(x):
            int8_acts = self.int8_activations
            return block_matmul.int8_block_matmul(x, self.qweight, self.scales, int8_acts)
        if self.backend == "triton":
            return _quant_kernels().int8_matmul(x, self.qweight, self.scales, self.group_size)
        if self._dequantizes(x):
            return self._dense_matmul(x)
        int8_mm = torch.ops.aten._weight_int8pack_mm
        if self.group_size is None:
            return int8_mm(x, self.qweight, self.scales)
        parts = x.split(self.group_size, dim=1)
        out = int8_mm(parts[0].contiguous(), self.qweight[0], self.scales[0]).float()
        for g in range(1, len(parts)):  # partial sums in fp32: bf16 would round each one
            out += int8_mm(parts[g].contiguous(), self.qweight[g], self.scales[g])
        return out.to(x.dtype)

    def _panel_source(self) -> tuple[DequantizeInto, None] | None:
        if self.backend != "blocks" or self.scales.dim() != 2:
            return None
        ops = torch.ops.radixserve_cpu
        return partial(ops.int8_block_dequantize_into, self.qweight, self.scales), None

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` of the weight, only those dequantized (backend "blocks")."""
        _check_rows_backend(self.backend, "Int8WeightOnlyLinear")
        scales = self.scales[index].repeat_interleave(self.group_size, dim=-1)
        return self.qweight[index].float() * scales

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.scales.dtype
        if self.group_size is None:
            return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]
        if self.backend == "blocks":
            scales = self.scales.to(dtype).repeat_interleave(self.group_size, dim=1)
            return self.qweight.to(dtype) * scales
        scales = self.scales.t().to(dtype).repeat_interleave(self.group_size, dim=1)  # [out, in]
        if self.backend == "triton":
            return self.qweight.to(dtype) * scales
        weight = self.qweight.transpose(0, 1).reshape(self.out_features, self.in_features)
        return weight.to(dtype) * scales


class Int4WeightOnlyLinear(QuantizedLinear):
    """4-bit weights with a scale and a zero per group, fp activations. CPU: torch's packed
    layout and kernel, or (32-wide groups, backend "blocks") GGUF-style blocks and the C++
    block kernel; CUDA: two codes per byte and the Triton kernel."""

    def __init__(
        self,
        codes: torch.Tensor,  # [out, in] int32 in 0..15
        scales: torch.Tensor,  # [out, in // group_size], activation dtype
        zeros: torch.Tensor,  # [out, in // group_size]: the weight that code 8 stands for
        group_size: int,
        bias: torch.Tensor | None = None,
        *,
        backend: str | None = None,  # "torch" (CPU only) | "triton"; None: by device
    ):
        out_features, in_features = codes.shape
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.backend = _backend(backend, codes.device)
        self.x8_type: int | None = None  # Q4_0_X8 / Q4_1_X8 once repacked (repack_rows8)
        _check_blocks(self.backend, group_size, "Int4WeightOnlyLinear")
        if self.backend == "triton":
            self._store_for_triton(codes, scales, zeros)
        elif self.backend == "blocks":
            self._store_blocks(codes, scales, zeros)
        else:
            self._store_for_torch_cpu(codes, scales, zeros)

    def _store_for_triton(self, codes, scales, zeros) -> None:
        self.register_buffer("packed", _quant_kernels().pack_int4(codes))  # [out, in // 2] uint8
        self.register_buffer("scales", scales.t().contiguous())  # [groups, out]
        self.register_buffer("zeros", zeros.t().to(scales.dtype).contiguous())

    def _store_blocks(self, codes, scales, zeros) -> None:
        self.register_buffer("qs", block_matmul.pack_int4_blocks(codes))  # [out, in // 2]
        scales = scales.float()
        offsets = zeros.float() - INT4_MID * scales  # w = q * scale + (zero - 8 * scale)
        self.register_buffer("scale_min", torch.stack([scales, offsets], dim=-1).contiguous())

    def _store_for_torch_cpu(self, codes, scales, zeros) -> None:
        if codes.device.type != "cpu":
            raise ValueError("Int4WeightOnlyLinear: backend 'torch' runs on CPU only")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        self.register_buffer("packed", packed)  # [out, in // 2] uint8, torch's CPU layout
        scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(scales.dtype)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())  # [groups, out, 2]

    @classmethod
    def from_float(
        cls, linear: nn.Linear, group_size: int, backend: str | None = None
    ) -> Int4WeightOnlyLinear:
        """Asymmetric min/max quantization per group of `group_size` input channels."""
        codes, scales, zeros = quantize_int4(linear.weight.detach(), group_size)
        dtype, bias = linear.weight.dtype, bias_of(linear)
        return cls(codes, scales.to(dtype), zeros.to(dtype), group_size, bias, backend=backend)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        if self.backend == "blocks":  # fp32 arithmetic on the input's dtype
            return None
        return self._buffers["scales" if self.backend == "triton" else "scales_and_zeros"].dtype

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        if self.backend == "blocks":
            raise ValueError("Int4WeightOnlyLinear: backend 'blocks' computes in fp32")
        if self.backend == "triton":
            self.scales, self.zeros = self.scales.to(dtype), self.zeros.to(dtype)
        else:
            self.scales_and_zeros = self.scales_and_zeros.to(dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            kernels = _quant_kernels()
            return kernels.int4_matmul(x, self.packed, self.scales, self.zeros, self.group_size)
        if self.backend == "blocks" and not self._dequantizes(x):
            if self.x8_type is not None and self.int8_activations:
                return q8_matmul.int4_x8_matmul_q8(x, self.x8, self.x8_type)
            qs, scale_min = self._row_blocks()
            return block_matmul.int4_block_matmul(x, qs, scale_min, self.int8_activations)
        if self._dequantizes(x) and (self.backend == "blocks" or packing_format() is not None):
            return self._dense_matmul(x)
        return self._cpu_kernel_matmul(x)

    def _cpu_kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return _INT4_MM_CPU(
            x.contiguous(), buffers["packed"], self.group_size, buffers["scales_and_zeros"]
        )

    def _panel_source(self) -> tuple[DequantizeInto, None] | None:
        if self.backend != "blocks":
            return None
        ops = torch.ops.radixserve_cpu
        if self.x8_type is None:
            return partial(ops.int4_block_dequantize_into, self.qs, self.scale_min), None
        return partial(ops.int4_x8_dequantize_into, self.x8, self.x8_type), None

    def _row_blocks(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `index` (all: None) as qs [n, in / 2] and scale_min [n, in / 32, 2]: the row
        layout, unpacked from a repacked layer's bytes (the same values)."""
        if self.x8_type is None:
            qs, scale_min = self._buffers["qs"], self._buffers["scale_min"]
            return (qs, scale_min) if index is None else (qs[index], scale_min[index])
        index = torch.arange(self.out_features) if index is None else index
        return torch.ops.radixserve_cpu.int4_unpack_x8(self.x8, self.x8_type, index.long())

    def can_repack(self) -> bool:
        """Whether `repack_rows8` applies: a "blocks" layer of at least 8 rows whose scales are
        a GGUF Q4_0's or Q4_1's (fp16), on a build running that layout natively (AVX-512 or
        AVX2)."""
        if self.backend != "blocks" or self.x8_type is not None:
            return False
        if self.out_features < q8_matmul.X8_ROWS or not q8_matmul.int4_x8_native():
            return False
        return block_matmul.int4_x8_type(self._buffers["scale_min"]) is not None

    def repack_rows8(self) -> None:
        """Rows -> 8 at a time with fp16 scales (q8_int4_x8.h: 18 / 20 bytes a block and row
        instead of 24), for the int8-activation kernel; every other path unpacks it to the
        row layout. The same results everywhere."""
        if not self.can_repack():
            raise ValueError(f"Int4WeightOnlyLinear: {self.extra_repr()} cannot repack")
        qtype = block_matmul.int4_x8_type(self._buffers["scale_min"])
        qs, scale_min = self._buffers.pop("qs"), self._buffers.pop("scale_min")
        self.register_buffer("x8", torch.ops.radixserve_cpu.int4_repack_x8(qs, scale_min, qtype))
        self.x8_type = qtype

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` (1-D) of the weight, only those dequantized (backend "blocks")."""
        _check_rows_backend(self.backend, "Int4WeightOnlyLinear")
        return self._blocks_weight(*self._row_blocks(index))

    def _blocks_weight(self, qs: torch.Tensor, scale_min: torch.Tensor) -> torch.Tensor:
        """fp32 weight rows of GGUF-style blocks: qs [n, k / 2], scale_min [n, k / 32, 2]."""
        n, k = qs.shape[0], self.in_features
        codes = block_matmul.unpack_int4_blocks(qs).view(n, k // self.group_size, -1)
        scales, offsets = (t[..., None] for t in scale_min.unbind(-1))  # fp32
        return torch.addcmul(offsets, codes.float(), scales).reshape(n, k)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.compute_dtype or torch.float32
        if self.backend == "blocks":
            return self._blocks_weight(*self._row_blocks()).to(dtype)
        if self.backend == "triton":
            codes = _quant_kernels().unpack_int4(self.packed)
            weight = dequantize_int4(codes, self.scales.t(), self.zeros.t(), self.group_size)
            return weight.to(dtype)
        fmt = packing_format()
        if fmt is None:  # the kernel's own reading of the packed codes: identity @ W.T = W.T
            eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
            return self._cpu_kernel_matmul(eye.to(self.packed.device)).t().to(dtype)
        n, k, g = self.out_features, self.in_features, self.group_size
        codes = unpack_codes(self.packed, n, k, fmt).view(n, k // g, g)
        scales, zeros = (t.t()[..., None].to(dtype) for t in self.scales_and_zeros.unbind(-1))
        offsets = zeros - INT4_MID * scales  # w = q * scale + (zero - 8 * scale)
        return torch.addcmul(offsets, codes.to(dtype), scales).reshape(n, k)


def matmul_backend(device: torch.device) -> str:
    """The kernels quantized layers built on `device` run: torch's packed CPU kernels, or
    our Triton dequant-GEMM on CUDA (tests force "triton" on CPU, under TRITON_INTERPRET=1)."""
    return "triton" if device.type == "cuda" else "torch"


def _backend(requested: str | None, device: torch.device) -> str:
    if requested is None:
        return matmul_backend(device)
    if requested not in MATMUL_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(MATMUL_BACKENDS)}; got {requested!r}")
    return requested


def _check_rows_backend(backend: str, layer: str) -> None:
    if backend != "blocks":
        raise ValueError(f"{layer}.dequantize_rows: backend 'blocks' only; got {backend!r}")


def _check_blocks(backend: str, group_size: int | None, layer: str) -> None:
    """A "blocks" layer: 32-wide groups, and the C++ ops loaded before its first call."""
    if backend != "blocks":
        return
    if group_size != block_matmul.BLOCK:
        raise ValueError(f"{layer}: backend 'blocks' needs group_size 32; got {group_size}")
    block_matmul.load_block_ops()


def _quant_kernels():
    """radixserve_kernels.quant_matmul, imported on first use (it needs triton)."""
    from radixserve_kernels import quant_matmul

    return quant_matmul


def quantize_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> codes [out, in] int32 in 0..15, scales and zeros [out, in // group_size]
    (fp32), so that w ~ (codes - 8) * scale + zero = codes * scale + group minimum."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-8)
    codes = torch.round((grouped - low[..., None]) / scales[..., None]).clamp(0, 15)
    zeros = low + INT4_MID * scales
    return codes.to(torch.int32).reshape(out_features, in_features), scales, zeros


def dequantize_int4(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The reference reading of int4 codes: (q - 8) * scale + zero, in fp32."""
    scale = scales.float().repeat_interleave(group_size, dim=1)
    zero = zeros.float().repeat_interleave(group_size, dim=1)
    return (codes.float() - INT4_MID) * scale + zero


__all__ = [
    "DEQUANT_MIN_ROWS",
    "FP8_MAX",
    "INT4_GROUP_SIZES",
    "INT4_MID",
    "INT4_OUT_MULTIPLE",
    "MATMUL_BACKENDS",
    "Fp8Linear",
    "Int4WeightOnlyLinear",
    "Int8WeightOnlyLinear",
    "QuantizedLinear",
    "UnquantizedLinear",
    "dense_linear",
    "dequantize_int4",
    "matmul_backend",
    "quantize_int4",
]
