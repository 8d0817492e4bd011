"""GPTQ and AWQ checkpoints (`--quantization gptq | awq`): their packed 4-bit projections
become `Int4WeightOnlyLinear` layers as they are, with no fp copy of a projection.

An HF folder whose config.json has `quantization_config.quant_method` gptq or awq stores,
per projection (q/k/v/o/gate/up/down_proj), with g = in_features // group_size groups:

    tensor   GPTQ (AutoGPTQ / GPTQModel)            AWQ (AutoAWQ, version gemm)
    qweight  int32 [in / 8, out]: word [r, c]       int32 [in, out / 8]: word [r, c] holds
             holds inputs 8r..8r+7 of column c,     columns 8c + AWQ_ORDER[j] of input r,
             input 8r + j in nibble j               AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7
    qzeros   int32 [g, out / 8], column 8c + j in   int32 [g, out / 8], same order as its
             nibble j; stored = zero - 1 in the     qweight; stored = zero
             v1 format (checkpoint_format gptq),
             zero in gptq_v2
    scales   fp16 [g, out]                          fp16 [g, out]
    g_idx    int32 [in]: each input's group         (none)

Both read w = (q - zero) * scale (nibble j = bits 4j..4j+3). Ours reads w = (q - 8) * s + z,
so s = scale and z = (8 - zero) * scale. A v1 zero of 0 is stored as -1, whose nibble is 15;
the zero is read back modulo 16, as AutoGPTQ does.

Under tensor parallelism (--tp-size > 1) each rank keeps its part of every projection, cut
from the unpacked codes, scales and zeros as the fp weight would be (model/tp_shard.py):
column-parallel layers (q/k/v, gate/up) along output columns (codes' rows, scales' and
zeros' rows, the bias); row-parallel ones (o_proj, down_proj) along whole groups of the
input (codes' columns, a slice of the groups), refused naming --tp-size where a rank's
inputs would cut a group. Act-order checkpoints (g_idx that regroups inputs) are refused at
every --tp-size (below). Every rank reads the whole packed checkpoint and keeps its part.

Read from quantization_config, anything else refused naming the option: `bits` 4,
`group_size` 32 | 64 | 128 (the int4 kernel's); GPTQ `desc_act` false (g_idx must then be
input // group_size), `sym` true or false (both read through qzeros), `checkpoint_format`
gptq | gptq_v2, no quantized `lm_head`; AWQ `version` gemm and `zero_point` true. Fused rows
as in the fp model: qkv_proj = q, k, v; gate_up_proj = gate, up. The embedding, norms, LM
head and projection biases are fp in these checkpoints and load in --dtype.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from radixserve.model.quant import QuantizationError
from radixserve.model.quant.linear import INT4_GROUP_SIZES, INT4_MID, Int4WeightOnlyLinear
from radixserve.model.source import ModelLoadError
from radixserve.model.tp_shard import ShardLayout

PACKED_METHODS = ("gptq", "awq")
BITS = 4
NIBBLE = (1 << BITS) - 1
SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)  # nibble j of a word: bits 4j..4j+3
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column 8c + AWQ_ORDER[j]
GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> stored zero's offset
PACKED_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
# our fused projection -> its HF parts, in row order
FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
HF_PROJECTIONS = tuple(part for parts in FUSED_PARTS.values() for part in parts)


def checkpoint_quant_method(hf_config: dict[str, Any]) -> str | None:
    """The lowercased `quantization_config.quant_method` of an HF config, or None."""
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    return None if method is None else str(method).lower()


@dataclass(frozen=True)
class PackedFormat:
    """How one GPTQ / AWQ checkpoint packs its projections."""

    method: str  # gptq | awq
    group_size: int
    zero_offset: int  # added to each stored zero: 1 for GPTQ's v1 format, else 0

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> PackedFormat:
        """Reads and checks `quantization_config`; refuses options we cannot run."""
        options = hf_config.get("quantization_config") or {}
        method = checkpoint_quant_method(hf_config)
        where = f"--quantization {method}: the checkpoint's quantization_config"
        if options.get("bits") != BITS:
            raise QuantizationError(
                f"{where} has bits={options.get('bits')!r}; only 4-bit checkpoints are read"
            )
        group_size = options.get("group_size")
        if group_size not in INT4_GROUP_SIZES:
            sizes = ", ".join(map(str, INT4_GROUP_SIZES))
            raise QuantizationError(
                f"{where} has group_size={group_size!r}; the int4 kernel takes {sizes}"
            )
        if method == "gptq":
            return cls(method, group_size, _gptq_zero_offset(options, where))
        _check_awq(options, where)
        return cls(method, group_size, 0)


def _gptq_zero_offset(options: dict[str, Any], where: str) -> int:
    if options.get("desc_act"):
        raise QuantizationError(
            f"{where} has desc_act=true (act-order: inputs regrouped through g_idx), which is "
            "not supported; use a checkpoint quantized with desc_act=false"
        )
    if options.get("lm_head"):
        raise QuantizationError(f"{where} has lm_head=true (a quantized LM head): not supported")
    checkpoint_format = options.get("checkpoint_format", "gptq")
    if checkpoint_format not in GPTQ_ZERO_OFFSETS:
        raise QuantizationError(
            f"{where} has checkpoint_format={checkpoint_format!r}; read are "
            f"{', '.join(GPTQ_ZERO_OFFSETS)}"
        )
    return GPTQ_ZERO_OFFSETS[checkpoint_format]


def _check_awq(options: dict[str, Any], where: str) -> None:
    version = str(options.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(
            f"{where} has version={version!r}; only gemm checkpoints are read "
            "(gemv, marlin and exllama pack their words differently)"
        )
    if options.get("zero_point", True) is not True:
        raise QuantizationError(
            f"{where} has zero_point={options.get('zero_point')!r}; only zero_point=true is read"
        )


class Int4Part(NamedTuple):
    """One HF projection in our int4 terms (see Int4WeightOnlyLinear)."""

    codes: torch.Tensor  # [out, in] int32 in 0..15
    scales: torch.Tensor  # [out, groups] fp32
    zeros: torch.Tensor  # [out, groups] fp32: the weight that code 8 stands for
    bias: torch.Tensor | None  # [out]


def load_packed_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], fmt: PackedFormat
) -> None:
    """Puts one Int4WeightOnlyLinear per fused projection into `model`, then loads the fp
    tensors (embedding, norms, LM head) through the model's own loader; a tensor-parallel
    rank (`model.layout`) keeps its part of each."""
    layout: ShardLayout = model.layout
    packed, fp_weights = split_packed(weights)
    for i, layer in enumerate(model.layers):
        for path, parts in FUSED_PARTS.items():
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            prefix = f"model.layers.{i}"
            hf_parts = [
                shard_part(read_part(packed, f"{prefix}.{part}", fmt), f"{prefix}.{part}", layout)
                for part in parts
            ]
            int4 = packed_layer(hf_parts, getattr(owner, attr), fmt, f"{prefix}.{path}")
            setattr(owner, attr, int4)
    if layout.size > 1:
        fp_weights = [(name, layout.select(name, tensor)) for name, tensor in fp_weights]
    model.load_weights(fp_weights)


def check_packed_shards(fmt: PackedFormat, layout: ShardLayout) -> None:
    """Refuses (the loader, before any weight is read) a --tp-size whose row-parallel
    slices would cut the checkpoint's groups (each rank must hold whole groups of o_proj's
    and down_proj's inputs)."""
    if layout.size == 1:
        return
    config = layout.config
    widths = {
        "o_proj": layout.num_heads * config.head_dim,
        "down_proj": layout.intermediate_size,
    }
    for name, per_rank in widths.items():
        if per_rank % fmt.group_size:
            raise QuantizationError(
                f"--tp-size {layout.size}: {name} keeps {per_rank} input columns per rank, "
                f"which cut the checkpoint's groups of {fmt.group_size} (quantization_config "
                f"group_size); use a --tp-size that leaves whole groups per rank, or --tp-size 1"
            )


def shard_part(part: Int4Part, module: str, layout: ShardLayout) -> Int4Part:
    """This rank's part of one HF projection (module docstring): output rows of a
    column-parallel one, whole groups of the input of a row-parallel one (whose bias only
    rank 0 keeps: the all-reduce sums it once)."""
    index = layout.hf_index(module + ".weight")
    if index is None:
        return part
    dim, start, stop = index
    if dim == 0:
        bias = None if part.bias is None else part.bias[start:stop]
        return Int4Part(
            part.codes[start:stop], part.scales[start:stop], part.zeros[start:stop], bias
        )
    group_size = part.codes.shape[1] // part.scales.shape[1]
    first, last = start // group_size, stop // group_size
    bias = part.bias
    if bias is not None and layout.zeroed(module + ".bias"):
        bias = torch.zeros_like(bias)
    return Int4Part(
        part.codes[:, start:stop], part.scales[:, first:last], part.zeros[:, first:last], bias
    )


def packed_layer(
    parts: list[Int4Part], fp_layer: nn.Linear, fmt: PackedFormat, name: str
) -> Int4WeightOnlyLinear:
    """The int4 layer that replaces `fp_layer` (same shape, bias and dtype)."""
    if fp_layer.bias is None:
        parts = [_without_zero_bias(part) for part in parts]
    layer = fused_int4_layer(parts, fmt.group_size, fp_layer.weight.dtype)
    _check_fits(layer, fp_layer, name)
    return layer


def split_packed(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> tuple[dict[str, dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Each projection's packed tensors and bias, by module name; and the fp rest."""
    packed: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    fp_weights = []
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        is_projection = module.endswith(tuple(f".{p}" for p in HF_PROJECTIONS))
        if kind in PACKED_TENSORS or (kind == "bias" and is_projection):
            packed[module][kind] = tensor
        else:
            fp_weights.append((name, tensor))
    return packed, fp_weights


def read_part(packed: dict, prefix: str, fmt: PackedFormat) -> Int4Part:
    """One projection's packed tensors -> codes, scales and zeros in our convention."""
    tensors = packed.get(prefix, {})
    for kind in ("qweight", "qzeros", "scales"):
        if kind not in tensors:
            raise ModelLoadError(
                f"{fmt.method} checkpoint has no {prefix}.{kind}: every attention and MLP "
                "projection must be packed"
            )
    if fmt.method == "gptq":
        codes = unpack_rows(tensors["qweight"])  # [in, out]
        _check_g_idx(tensors.get("g_idx"), codes.shape[0], fmt.group_size, prefix)
        zeros = (unpack_columns(tensors["qzeros"]) + fmt.zero_offset) & NIBBLE
    else:
        codes = unpack_columns(tensors["qweight"], AWQ_ORDER)  # [in, out]
        zeros = unpack_columns(tensors["qzeros"], AWQ_ORDER)
    scales = tensors["scales"].float()  # [groups, out]
    expected = (codes.shape[0] // fmt.group_size, codes.shape[1])
    for kind, tensor in (("scales", scales), ("qzeros", zeros)):
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(
                f"{prefix}.{kind} unpacks to {tuple(tensor.shape)}; qweight and group_size="
                f"{fmt.group_size} ask for {expected}"
            )
    ours = (INT4_MID - zeros) * scales
    return Int4Part(codes.t(), scales.t(), ours.t(), tensors.get("bias"))


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols] int32 words -> [rows, cols, 8]: nibble j of each word."""
    return (packed.to(torch.int32)[..., None] >> SHIFTS) & NIBBLE


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight [in / 8, out] -> [in, out]: word [r, c] holds rows 8r..8r+7."""
    return _nibbles(packed).permute(0, 2, 1).reshape(-1, packed.shape[1])


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[rows, cols / 8] -> [rows, cols]: nibble j of word [r, c] is column 8c + order[j]."""
    nibbles = _nibbles(packed)
    columns = torch.empty_like(nibbles)
    columns[..., list(order)] = nibbles
    return columns.reshape(packed.shape[0], -1)


def _check_g_idx(g_idx: torch.Tensor | None, in_features: int, group_size: int, prefix: str):
    if g_idx is None:
        return
    trivial = torch.arange(in_features) // group_size
    if g_idx.shape != trivial.shape or not torch.equal(g_idx.long(), trivial):
        raise QuantizationError(
            f"--quantization gptq: {prefix}.g_idx regroups the inputs (act-order), although "
            "quantization_config has desc_act=false; such checkpoints are not supported"
        )


def _without_zero_bias(part: Int4Part) -> Int4Part:
    """Some GPTQ packers save an all-zero bias for every projection; a model without
    biases drops it (a non-zero one is still an error)."""
    if part.bias is not None and not part.bias.any():
        return part._replace(bias=None)
    return part


def fused_int4_layer(
    parts: list[Int4Part], group_size: int, dtype: torch.dtype
) -> Int4WeightOnlyLinear:
    """One int4 layer whose rows are `parts`' rows, stacked in order."""
    biases = [p.bias for p in parts]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ModelLoadError("checkpoint has biases for some parts of a fused projection only")
    bias = None if biases[0] is None else torch.cat(biases).to(dtype)
    return Int4WeightOnlyLinear(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]).to(dtype),
        torch.cat([p.zeros for p in parts]).to(dtype),
        group_size,
        bias,
    )


def _check_fits(layer: Int4WeightOnlyLinear, fp_layer: nn.Linear, name: str) -> None:
    """The packed layer has the fp layer's shape, and a bias where the model has one."""
    shape, expected = (layer.out_features, layer.in_features), tuple(fp_layer.weight.shape)
    if shape != expected:
        raise ModelLoadError(f"{name}: packed tensors give {shape}, the model needs {expected}")
    if (layer.bias is None) != (fp_layer.bias is None):
        if layer.bias is None:
            raise ModelLoadError(f"{name}: the model config declares a bias the checkpoint lacks")
        raise ModelLoadError(f"{name}: the checkpoint has a bias the model config does not declare")
