"""GGUF tensors as our layers: one weight's blocks decoded (`decode_block_weight`: int4 codes /
int8 values with fp32 block scales, K-quant super-blocks as a view of the mapped file, or fp32
values) and the layer that runs them (`fused_layer`). gguf_weights.py puts them into a model.

Q4_0 / Q4_1 / Q8_0 codes are copied: the kernels read each row's codes contiguous, the file
interleaves them with each block's fp16 scale (18 / 20 / 34-byte blocks). IQ4_NL (a 4-bit
index into a table of 16 int8 values, one fp16 scale per 32) becomes Q8_0 exactly: each
code's table value is the int8 code, under the same scale; the Q8_0 kernels run it, at twice
the file's bytes (no 4-bit kernel of ours reads the table). K-quant bytes are
the kernels' layout already, so their layers hold the file's pages (no copy, no anonymous
memory): one layer per part (q, k, v; gate, up), since stacking parts into one tensor would copy
them, and llama.cpp's permuted q / k rows stay as they lie (the layer reorders its outputs).
"""

from __future__ import annotations

import itertools
import logging
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from radixserve.model.gguf_file import GGUFTensor
from radixserve.model.quant.base_linear import fixed_dense_layer
from radixserve.model.quant.kquant import (
    KQUANT_TYPES,
    KQuantLinear,
    kquant_dequantize,
    kquant_ops_available,
)
from radixserve.model.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from radixserve.model.quant.stacked_linear import StackedLinear
from radixserve.model.source import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_BLOCK = 32
FP_TYPES = ("F32", "F16", "BF16")
AS_IS_TYPES = ("Q4_0", "Q4_1", "Q8_0", "IQ4_NL")
IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)  # ggml's kvalues_iq4nl: an IQ4_NL weight is d * IQ4_NL_VALUES[code]


class BlockWeight(NamedTuple):
    """One GGUF weight in our terms: int4 codes + scales + zeros, int8 + scales, K-quant
    super-blocks as stored, or fp."""

    kind: str  # "int4" | "int8" (Q8_0, IQ4_NL) | "fp" | "Q4_K" | "Q5_K" | "Q6_K"
    values: torch.Tensor  # [rows, in]: int32 codes 0..15 | int8 | fp32 weight; K-quants:
    # [rows, in / 256 * block bytes] uint8, the mapped file's bytes
    scales: torch.Tensor | None = None  # [rows, in // 32] fp32
    zeros: torch.Tensor | None = None  # [rows, in // 32] fp32 (int4 only)
    row_order: torch.Tensor | None = None  # output j is row row_order[j] of the above (None:
    # in order); K-quant q / k rows keep the file's order and are reordered after the matmul

    def take_rows(self, index: torch.Tensor) -> BlockWeight:
        """The rows `index` (of the output order), copied."""
        if self.row_order is not None:
            index = self.row_order[index]
        parts = (self.values, self.scales, self.zeros)
        return BlockWeight(self.kind, *(None if t is None else t[index] for t in parts))


def decode_block_weight(tensor, kquants: bool = False) -> BlockWeight:
    """A GGUF tensor -> int4 codes / int8 values with their block scales, K-quant blocks as
    stored (if `kquants`: else dequantized), or fp32 values."""
    kind = tensor.tensor_type.name
    if kind in FP_TYPES or (kind in KQUANT_TYPES and not kquants):
        return BlockWeight("fp", torch.from_numpy(dequantize_tensor(tensor)))
    if kind in KQUANT_TYPES:  # [rows, bytes] as stored: a GGUFFile's, a view of the mapped
        if isinstance(tensor, GGUFTensor):  # file (no copy); any other array's, a copy
            return BlockWeight(kind, tensor.torch_bytes())
        return BlockWeight(kind, torch.from_numpy(np.array(tensor.data, dtype=np.uint8)))
    if kind not in AS_IS_TYPES:
        raise ModelLoadError(
            f"--quantization gguf reads Q4_0, Q4_1, Q8_0, IQ4_NL, Q4_K, Q5_K and Q6_K tensors "
            f"as blocks; {tensor.name} is {kind} (use --quantization none to dequantize it)"
        )
    from gguf import GGML_QUANT_SIZES

    _, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    rows = tensor.data.shape[0]
    blocks = np.asarray(tensor.data).reshape(rows, -1, block_bytes)
    scales = _f16(blocks[..., 0:2])
    if kind == "Q8_0":
        values = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
        return BlockWeight("int8", values.reshape(rows, -1), scales)
    if kind == "IQ4_NL":  # d * table[code]: the table's entries are int8, so exactly Q8_0's
        codes = _nibbles(blocks[..., 2:]).numpy()  # w = q * d with q = table[code]
        return BlockWeight("int8", torch.from_numpy(IQ4_NL_VALUES[codes]), scales)
    if kind == "Q4_0":
        return BlockWeight("int4", _nibbles(blocks[..., 2:]), scales, torch.zeros_like(scales))
    minimum = _f16(blocks[..., 2:4])
    return BlockWeight("int4", _nibbles(blocks[..., 4:]), scales, minimum + 8 * scales)


def _f16(raw: np.ndarray) -> torch.Tensor:
    """[rows, blocks, 2] bytes -> [rows, blocks] fp32 (exact: fp16 fits fp32)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(raw: np.ndarray) -> torch.Tensor:
    """[rows, blocks, 16] bytes -> [rows, blocks * 32] int32 codes: low nibbles are the
    block's first 16 elements, high nibbles its last 16."""
    low, high = raw & 0x0F, raw >> 4
    codes = np.concatenate([low, high], axis=-1).astype(np.int32)
    return torch.from_numpy(codes.reshape(raw.shape[0], -1))


def fused_layer(
    weights: list[BlockWeight],
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    backend: str | None = None,
) -> nn.Module | None:
    """One layer on `device` (its layout is its kernel's: `backend`, by default the
    device's) from the stacked rows of `weights`; None if they are all fp. K-quant parts are
    a layer each over the mapped file (concatenating them would copy the file's bytes);
    other parts: one layer per run of same-kind parts. Several layers: a StackedLinear."""
    kinds = {w.kind for w in weights}
    if kinds == {"fp"}:
        return None
    if kinds & set(KQUANT_TYPES) and (device.type != "cpu" or backend != "blocks"):
        raise ModelLoadError(f"{what}: K-quant blocks run on the CPU block kernels only")
    layers: list[nn.Module] = []
    for kind, run in itertools.groupby(weights, key=lambda w: w.kind):
        run = list(run)
        if kind in KQUANT_TYPES:
            layers += [KQuantLinear(w.values, kind, row_order=w.row_order) for w in run]
        else:
            layers.append(_run_layer(run, dtype, device, backend))
    if len(layers) == 1:
        return layers[0]
    logger.debug("%s: %d parts stacked", what, len(layers))
    return StackedLinear(layers)


def _run_layer(weights: list[BlockWeight], dtype, device, backend: str | None) -> nn.Module:
    """One int4 / int8 / fp layer from a run of same-kind parts, their rows concatenated. fp
    parts: a dense layer whose weight is a buffer, as the quantized parts' are (load_weights
    fills and checks parameters only)."""
    values = torch.cat([w.values for w in weights]).to(device)
    if weights[0].kind == "fp":
        return fixed_dense_layer(values.to(dtype))
    dtype = torch.float32 if backend == "blocks" else dtype  # blocks keep fp16 scales exact
    scales = torch.cat([w.scales for w in weights]).to(device, dtype)
    if weights[0].kind == "int8":
        return Int8WeightOnlyLinear(values, scales, group_size=GGUF_BLOCK, backend=backend)
    zeros = torch.cat([w.zeros for w in weights]).to(device, dtype)
    return Int4WeightOnlyLinear(values, scales, zeros, GGUF_BLOCK, backend=backend)


def dequantize_tensor(tensor) -> np.ndarray:
    """fp32 values of a GGUF tensor: K-quants by our C++ kernels where they load (the same
    values as gguf's numpy code, bit for bit, without its temporaries: a 1B model's embedding
    is 262M weights), anything else by the gguf package."""
    from gguf.quants import dequantize

    name = tensor.tensor_type.name
    if name in KQUANT_TYPES and len(tensor.data.shape) == 2 and kquant_ops_available():
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        return kquant_dequantize(blocks, KQUANT_TYPES[name][0]).numpy()
    return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # a copy:
    # the reader's arrays are read-only views of the mapped file
