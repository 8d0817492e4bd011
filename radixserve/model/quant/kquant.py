"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as the file stores them, on the C++ kernels of
native/csrc/kquant_matmul.cpp (backend "blocks" only: torch has no kernel for them).

A weight row is K / 256 super-blocks of 256 weights, the GGUF bytes as they are:

    type  bytes / 256 weights  bits / weight  per 32 weights (one unit)
    Q4_K  144                  4.5            6-bit scale and min: w = d*sc * q - dmin*m
    Q5_K  176                  5.5            likewise, q with a fifth bit
    Q6_K  210                  6.5625         int8 scale per 16: w = d*sc * (q - 32)

Each unit is dequantized to fp32 once, exactly as the gguf package's numpy reference does,
and multiplied into the activation rows with fp32 FMAs in a fixed order: the dequantized
matmul up to fp32 summation order, each row's result the same whatever rows share the call.
With int8 activations (activation_choice.py) the kernel is q8_matmul.py's integer dots instead,
and a Q4_K / Q5_K / Q6_K layer there takes its rows 8 at a time (`repack_rows8`: the AVX-512
and AVX2 kernels then share each super-block's scale work across 8 rows, as llama.cpp's
repacked Q4_K does; the same bits as the row layout, at any number of rows).
`KQuantLinear` is the layer; from `dequant_min_rows` rows on (a prefill chunk) it dequantizes
(also in C++) and runs one dense matmul, like the other block layers.
"""

from __future__ import annotations

import functools
from functools import partial

import torch

from radixserve.model.gguf_file import release_pages
from radixserve.model.quant import q8_matmul
from radixserve.model.quant.dense_panels import DequantizeInto
from radixserve.model.quant.linear import QuantizedLinear
from radixserve.model.quant.q8_matmul import X8_ROWS, X8_TYPE, kquant_x8_native

SUPER_BLOCK = 256  # weights per super-block (GGUF's QK_K)
# GGUF type name -> (ggml type id, bytes per super-block)
KQUANT_TYPES = {"Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
# Q4_K / Q5_K / Q6_K rows repacked 8 at a time (native/csrc/kquant_blocks.h)
Q4_K_X8, Q5_K_X8, Q6_K_X8 = 12 + X8_TYPE, 13 + X8_TYPE, 14 + X8_TYPE


@functools.cache
def load_kquant_ops() -> None:
    """Loads the extension and tells torch.compile's tracer what the ops return."""
    from radixserve.native.extension import load_cpu_ops

    load_cpu_ops()
    q8_matmul.load_q8_ops()

    @torch.library.register_fake("radixserve_cpu::kquant_mm")
    def _mm_fake(x, blocks, qtype):
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("radixserve_cpu::kquant_dequantize")
    def _dequantize_fake(blocks, qtype):
        ggml_type = qtype - X8_TYPE if qtype > X8_TYPE else qtype
        bytes_per_block = next(b for t, b in KQUANT_TYPES.values() if t == ggml_type)
        k = blocks.shape[1] // bytes_per_block * SUPER_BLOCK
        return blocks.new_empty(blocks.shape[0], k, dtype=torch.float32)


@functools.cache
def kquant_ops_available() -> bool:
    """True if the C++ extension (any SIMD level) loads here."""
    from radixserve.native.extension import CpuExtensionUnavailable

    try:
        load_kquant_ops()
    except CpuExtensionUnavailable:
        return False
    return True


def kquant_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """[M, K] fp32 / bf16 @ K-quant blocks.T -> [M, N] in x's dtype (fp32 arithmetic)."""
    return torch.ops.radixserve_cpu.kquant_mm(x.contiguous(), blocks, qtype)


def kquant_dequantize(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """[N, K / 256 * bytes] uint8 -> [N, K] fp32: the weights the kernel multiplies by."""
    return torch.ops.radixserve_cpu.kquant_dequantize(blocks, qtype)


class KQuantLinear(QuantizedLinear):
    """One GGUF K-quant weight, [out, in / 256 * bytes] uint8 as stored, on the C++ kernels.
    Computes in fp32 on fp32 or bf16 inputs (compute_dtype None, like the "blocks" layers).
    `blocks` may be a view of a mapped GGUF file: the layer never writes to it, and keeps its
    rows as they lie; `row_order` (output j is blocks row row_order[j]) reorders the outputs
    instead (llama.cpp's permuted q / k rows)."""

    backend = "blocks"

    def __init__(
        self,
        blocks: torch.Tensor,
        type_name: str,
        bias: torch.Tensor | None = None,
        row_order: torch.Tensor | None = None,
    ):
        if type_name not in KQUANT_TYPES:
            raise ValueError(f"KQuantLinear: {type_name} is not one of {', '.join(KQUANT_TYPES)}")
        self.qtype, bytes_per_block = KQUANT_TYPES[type_name]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % bytes_per_block:
            shape = f"[out, in / 256 * {bytes_per_block}]"
            got = f"{tuple(blocks.shape)} {blocks.dtype}"
            raise ValueError(f"KQuantLinear: {type_name} blocks must be {shape} uint8; got {got}")
        in_features = blocks.shape[1] // bytes_per_block * SUPER_BLOCK
        super().__init__(in_features, blocks.shape[0], bias)
        self.type_name = type_name
        if row_order is not None and row_order.shape != (blocks.shape[0],):
            raise ValueError(f"KQuantLinear: row_order must be [{blocks.shape[0]}]")
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("row_order", row_order)
        load_kquant_ops()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._dequantizes(x):
            return self._dense_matmul(x)
        if self.int8_activations:
            out = q8_matmul.kquant_matmul_q8(x, self._buffers["blocks"], self.qtype)
        else:
            out = kquant_matmul(x, self._buffers["blocks"], self.qtype)
        order = self._buffers["row_order"]
        return out if order is None else out.index_select(1, order)

    def _panel_source(self) -> tuple[DequantizeInto, torch.Tensor | None]:
        ops = torch.ops.radixserve_cpu
        into = partial(ops.kquant_dequantize_into, self._buffers["blocks"], self.qtype)
        return into, self._buffers["row_order"]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        weight = kquant_dequantize(self._buffers["blocks"], self.qtype)
        order = self._buffers["row_order"]
        weight = weight if order is None else weight.index_select(0, order)
        return weight if dtype in (None, torch.float32) else weight.to(dtype)

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` (1-D) of the weight: only their blocks are read and dequantized."""
        order = self._buffers["row_order"]
        rows = index if order is None else order[index]
        blocks = self._buffers["blocks"]
        if self.qtype < X8_TYPE:
            return kquant_dequantize(blocks.index_select(0, rows), self.qtype)
        out = torch.empty(len(rows), self.in_features)
        for i, row in enumerate(rows.tolist()):  # a repacked row is spread over its group
            torch.ops.radixserve_cpu.kquant_dequantize_into(blocks, self.qtype, row, out[i : i + 1])
        return out

    def can_repack(self) -> bool:
        """Whether `repack_rows8` applies: a K-quant layer of at least 8 rows, on a build
        whose int8 kernels run the repacked layout natively (AVX-512, AVX2)."""
        repackable = self.qtype < X8_TYPE
        return repackable and self.out_features >= X8_ROWS and kquant_x8_native()

    def repack_rows8(self, release_file_pages: bool = True) -> None:
        """Rows -> 8 at a time (kquant_blocks.h), every kernel and dequantizer then reading
        that layout with the same results; the rows go in the outputs' order (`row_order` is
        applied here, once, not after every matmul). The repacked bytes are a copy (anonymous
        memory, the weight's size); with `release_file_pages` the old view's pages of a mapped
        file are given back (gguf_file.release_pages), so a repacked weight costs its size once."""
        if not self.can_repack():
            raise ValueError(f"KQuantLinear.repack_rows8: {self.extra_repr()} cannot repack")
        old, order = self._buffers["blocks"], self._buffers["row_order"]
        rows = old if order is None else old.index_select(0, order)
        self._buffers["blocks"] = torch.ops.radixserve_cpu.kquant_repack_x8(rows, self.qtype)
        self._buffers["row_order"] = None
        self.qtype += X8_TYPE
        if release_file_pages:
            release_pages(old)

    def extra_repr(self) -> str:
        layout = ", rows 8 at a time" if self.qtype > X8_TYPE else ""
        return f"{super().extra_repr()}, type={self.type_name}{layout}"
