"""A GGUF file's Q4_0 / Q4_1 / Q8_0 and Q4_K / Q5_K / Q6_K projections loaded as they are
(`--quantization gguf`, and `auto` where every projection is one of these or fp).

Block codes and block scales become the int4 / int8 layers' layout directly; no fp32 copy
of a projection is ever made. One GGUF block is 32 inputs of one row, so group size is 32.

    type  block bytes                          GGUF reads        our layer, w = ...
    Q4_0  d f16 | 16 B nibbles                 (q - 8) * d       int4: scale d, zero 0
    Q4_1  d f16 | m f16 | 16 B nibbles         q * d + m         int4: scale d, zero m + 8d
    Q8_0  d f16 | 32 B int8                    q * d             int8: group-wise scale d
    byte j of a nibble block = element j (low 4 bits) | element j + 16 (high 4 bits)
    Q4_K / Q5_K / Q6_K: super-blocks of 256, kept as the file's bytes (KQuantLinear, kquant.py)

K-quants run on our C++ kernels only (the "blocks" backend); with torch's kernels (or no
SIMD build) they are dequantized to fp at load, and the log says so. The parts of one fused
layer (qkv, gate_up) may differ in type, as llama.cpp's mixes (Q4_K_M: Q6_K attn_v in some
layers) have it: each run of same-type parts is its own layer (StackedLinear).
F32 / F16 / BF16 projections stay fp. The embedding and norms are fp by design and are dequantized;
so is the LM head (tied: the embedding; untied: output.weight), unless the layers use the C++
"blocks" kernels (block_matmul.py): then a Q4_0 / Q4_1 / Q8_0 / K-quant head is kept as its blocks
too (the default model's tied Q8_0 head: 32 MiB read per token instead of 113 MiB), and the
embedding keeps its fp rows for the lookup. llama.cpp stores q and k rows permuted for its RoPE
layout; rows are permuted back here (codes and scales alike). The `llama` GGUF architecture
(Llama, Mistral, SmolLM, ...) and the MoE ones (qwen3moe, qwen2moe, llama with experts: Mixtral;
their experts in gguf_moe.py) are read this way; anything else: `--quantization none`.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterator
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from radixserve.config import ModelConfig
from radixserve.model.quant.base_linear import fixed_dense_layer
from radixserve.model.quant.gguf_config import (  # read_gguf, gguf_hf_config: re-exported
    field,
    gguf_hf_config,  # noqa: F401
    read_gguf,  # noqa: F401
)
from radixserve.model.quant.gguf_moe import (
    EXPERT_PARTS,
    GGUF_ARCHITECTURES,
    SHARED_PARTS,
    Builders,
    load_moe_layer,
)
from radixserve.model.quant.gguf_shard import shard_head, shard_weight
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
# A tied blocks head multiplies by the fp embedding from this many rows on (SmolLM2's 49152 x
# 576 Q8_0 head, 1 thread: blocks 12 ms vs dense 23 ms at 16 rows, 23 vs 22.5 at 24, 64 vs 41
# at 64).
HEAD_DENSE_MIN_ROWS = 24
FP_TYPES = ("F32", "F16", "BF16")
# our fused projection -> its GGUF parts, in row order
FUSED_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
FP_NAMES = {  # GGUF name -> HF name; blk.N.* -> model.layers.N.*
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

PERMUTED_QK = ("LlamaForCausalLM", "MixtralForCausalLM")  # llama.cpp's `llama` architecture
HF_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class BlockWeight(NamedTuple):
    """One GGUF weight in our terms: int4 codes + scales + zeros, int8 + scales, K-quant
    super-blocks as stored, or fp."""

    kind: str  # "int4" | "int8" | "fp" | "Q4_K" | "Q5_K" | "Q6_K"
    values: torch.Tensor  # [rows, in]: int32 codes 0..15 | int8 | fp32 weight; K-quants:
    # [rows, in / 256 * block bytes] uint8
    scales: torch.Tensor | None = None  # [rows, in // 32] fp32
    zeros: torch.Tensor | None = None  # [rows, in // 32] fp32 (int4 only)

    def take_rows(self, index: torch.Tensor) -> BlockWeight:
        return BlockWeight(self.kind, *(None if t is None else t[index] for t in self[1:]))


def load_gguf_weights(
    model: nn.Module, reader, config: ModelConfig, blocks: bool = False, dequantize: bool = False
) -> None:
    """Puts packed int4/int8 projections into `model` (on the C++ block kernels if `blocks`,
    else the device's default kernels) and loads every fp tensor; with `blocks`, a quantized
    LM head too; with `dequantize`, every tensor as fp32 (an MoE GGUF at --quantization none).
    A tensor-parallel shard (`model.layout` of several ranks) gets its part of each, cut from
    the blocks (gguf_shard.py). Routed layers: gguf_moe.py."""
    backend = "blocks" if blocks else None
    layout = model.layout if model.layout.size > 1 else None
    tensors = {t.name: t for t in reader.tensors}
    log_projection_types(tensors, blocks)
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    fp_weights: list[tuple[str, torch.Tensor]] = []
    decode = partial(decode_weight, kquants=blocks, dequantize=dequantize)
    fused = partial(fused_layer, dtype=dtype, device=device, backend=backend)
    build = Builders(decode, fused, _dequantize)
    for i, layer in enumerate(model.layers):
        for path, parts in FUSED_PARTS.items():
            if path.startswith("mlp.") and config.is_sparse_layer(i):
                continue
            names = [f"model.layers.{i}.{HF_PARTS[p]}.weight" for p in parts]
            weights = [
                shard_weight(layer_weight(tensors, i, part, config, decode), name, layout)
                for part, name in zip(parts, names)
            ]
            module = fused(weights, what=f"blk.{i}: {', '.join(parts)}")
            biases = _biases(tensors, i, parts, names, layout)
            if module is None:  # fp in the file: the fp loader fills the fused rows
                fp_weights += [(n, w.values) for n, w in zip(names, weights)] + biases
            else:
                if biases:
                    attach_bias(module, torch.cat([b for _, b in biases]))
                owner_name, attr = path.split(".")
                setattr(getattr(layer, owner_name), attr, module)
        if config.is_sparse_layer(i):
            fp_weights += load_moe_layer(model, tensors, i, build)
    head = block_lm_head(tensors, dtype, device, layout) if blocks else None
    if head is not None:  # before the fp weights: an untied head's fp parameter goes
        tensors.pop("output.weight", None)  # not loaded as fp (absent when tied)
        attach_block_head(model, head)
    fp = fp_tensors(tensors)
    if layout is not None:  # fp projections are cut already
        fp = ((name, layout.select(name, tensor)) for name, tensor in fp)
    model.load_weights([*fp_weights, *fp])


def _biases(tensors: dict, layer: int, parts, names, layout) -> list[tuple[str, torch.Tensor]]:
    """The HF-named fp32 biases of one fused projection's parts (Qwen2's q / k / v), this
    rank's part of each; [] when the file has none."""
    found = []
    for part, name in zip(parts, names):
        if (tensor := tensors.get(f"blk.{layer}.{part}.bias")) is not None:
            bias_name, values = name.removesuffix("weight") + "bias", _dequantize(tensor)
            values = torch.from_numpy(values)
            found.append(
                (bias_name, values if layout is None else layout.select(bias_name, values))
            )
    return found


def attach_bias(module: nn.Module, bias: torch.Tensor) -> None:
    """Gives a fused layer built from blocks its bias (Qwen2's q / k / v), split over the
    parts of a StackedLinear; a buffer, as the layers' weights are."""
    start = 0
    for part in module.parts if isinstance(module, StackedLinear) else [module]:
        part_bias = bias[start : start + part.out_features].to(device=_device_of(part))
        start += part.out_features
        if "bias" in part._parameters:  # a dense part (nn.Linear): its bias a buffer too
            del part.bias
        part.register_buffer("bias", part_bias)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.buffers()).device


def attach_block_head(model: nn.Module, head: nn.Module) -> None:
    """Makes `head` the LM head; a tied one multiplies by the embedding (the same weights in
    fp, filled in place later by load_weights) from HEAD_DENSE_MIN_ROWS rows on."""
    if model.lm_head is None:
        head.share_dense_weight(model.embed_tokens.weight, HEAD_DENSE_MIN_ROWS)
    model.lm_head = head


def block_lm_head(
    tensors: dict, dtype: torch.dtype, device: torch.device, layout=None
) -> nn.Module | None:
    """The LM head (output.weight, or the tied token_embd.weight) as a layer on the block
    kernels, if the file stores it as Q4_0 / Q4_1 / Q8_0 or a K-quant; else None (fp head).
    `layout`: a tensor-parallel shard's, which holds its vocab rows only."""
    tensor = tensors.get("output.weight", tensors["token_embd.weight"])
    if tensor.tensor_type.name not in (*AS_IS_TYPES, *KQUANT_TYPES):
        return None
    weight = shard_head(decode_block_weight(tensor, kquants=True), layout)
    return fused_layer([weight], dtype, device, tensor.name, "blocks")


AS_IS_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def projection_types(tensors) -> Counter:
    """GGUF type name -> how many layer projections (blk.N.attn_q ... ffn_down, an MoE
    layer's stacked experts and shared expert) have it."""
    parts = tuple(f".{part}.weight" for part in (*HF_PARTS, *EXPERT_PARTS, *SHARED_PARTS))
    return Counter(t.tensor_type.name for t in tensors if t.name.endswith(parts))


def loads_as_is(reader, kquants: bool = False) -> bool:
    """True if `--quantization auto` means gguf for this file: a llama or MoE GGUF
    whose layer projections are Q4_0 / Q4_1 / Q8_0 (the default model's are Q4_1), K-quants
    if `kquants` (the block kernels run here), or fp, with at least one quantized."""
    if field(reader, "general.architecture") not in GGUF_ARCHITECTURES:
        return False
    quantized = {*AS_IS_TYPES, *(KQUANT_TYPES if kquants else ())}
    kinds = set(projection_types(reader.tensors))
    return bool(kinds & quantized) and kinds <= {*quantized, *FP_TYPES}


def why_not_as_is(reader, kquants: bool = False) -> str:
    """Why `loads_as_is` is False for this file, in words for the log."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        names = ", ".join(GGUF_ARCHITECTURES)
        return f"its architecture is {arch!r} (blocks are read for {names} only)"
    types = ", ".join(f"{n} {t}" for t, n in sorted(projection_types(reader.tensors).items()))
    reason = f"its projections ({types}) are not all Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/fp"
    if not kquants and set(projection_types(reader.tensors)) & set(KQUANT_TYPES):
        reason += " runnable here (K-quants need the C++ block kernels)"
    return reason


def log_projection_types(tensors: dict, blocks: bool) -> None:
    """One line: each projection type, how many, and how it loads."""
    types = projection_types(tensors.values())
    kquants = sorted(set(types) & set(KQUANT_TYPES))
    logger.info("GGUF projections: %s", ", ".join(f"{n} {t}" for t, n in sorted(types.items())))
    if kquants and not blocks:
        logger.info(
            "GGUF %s projections dequantized to fp: torch has no kernel for them and the C++ "
            "block kernels are off here (--cpu-quant-kernel auto runs them as blocks)",
            "/".join(kquants),
        )


def layer_weight(tensors: dict, layer: int, part: str, config: ModelConfig, decode) -> BlockWeight:
    """One projection of one layer, decoded by `decode` (`decode_weight`); q and k rows back
    in HF order (llama.cpp permutes them for llama and Mixtral, not for Qwen)."""
    name = f"blk.{layer}.{part}.weight"
    if name not in tensors:
        raise ModelLoadError(f"GGUF file is missing tensor {name}")
    weight = decode(tensors[name])
    if part in ("attn_q", "attn_k") and config.architecture in PERMUTED_QK:
        heads = config.num_heads if part == "attn_q" else config.num_kv_heads
        weight = weight.take_rows(unpermute_index(len(weight.values), heads))
    return weight


def unpermute_index(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: per head, rows (2, half) were
    stored as (half, 2)."""
    rows = torch.arange(num_rows).reshape(num_heads, num_rows // num_heads // 2, 2)
    return rows.transpose(1, 2).reshape(-1)


def decode_weight(tensor, kquants: bool = False, dequantize: bool = False) -> BlockWeight:
    """`decode_block_weight`, or (`dequantize`) the tensor's fp32 values whatever its type."""
    if dequantize:
        return BlockWeight("fp", torch.from_numpy(_dequantize(tensor)))
    return decode_block_weight(tensor, kquants)


def decode_block_weight(tensor, kquants: bool = False) -> BlockWeight:
    """A GGUF tensor -> int4 codes / int8 values with their block scales, K-quant blocks as
    stored (if `kquants`: else dequantized), or fp32 values."""
    kind = tensor.tensor_type.name
    if kind in FP_TYPES or (kind in KQUANT_TYPES and not kquants):
        return BlockWeight("fp", torch.from_numpy(_dequantize(tensor)))
    if kind in KQUANT_TYPES:  # [rows, bytes] as stored; a copy: the file's map is read-only
        return BlockWeight(kind, torch.from_numpy(np.array(tensor.data, dtype=np.uint8)))
    if kind not in AS_IS_TYPES:
        raise ModelLoadError(
            f"--quantization gguf reads Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K tensors as they "
            f"are; {tensor.name} is {kind} (use --quantization none to dequantize it)"
        )
    from gguf import GGML_QUANT_SIZES

    _, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    rows = tensor.data.shape[0]
    blocks = np.asarray(tensor.data).reshape(rows, -1, block_bytes)
    scales = _f16(blocks[..., 0:2])
    if kind == "Q8_0":
        values = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
        return BlockWeight("int8", values.reshape(rows, -1), scales)
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
    device's) from the stacked rows of `weights`; None if they are all fp. Parts of
    different kinds: a StackedLinear of one layer per run of same-kind parts."""
    kinds = {w.kind for w in weights}
    if kinds == {"fp"}:
        return None
    if len(kinds) > 1:
        runs = [list(run) for _, run in itertools.groupby(weights, key=lambda w: w.kind)]
        logger.debug("%s: %s parts stacked", what, " + ".join(run[0].kind for run in runs))
        return StackedLinear([_part_layer(run, dtype, device, backend) for run in runs])
    if weights[0].kind in KQUANT_TYPES:
        if device.type != "cpu" or backend != "blocks":
            raise ModelLoadError(f"{what}: K-quant blocks run on the CPU block kernels only")
        return KQuantLinear(torch.cat([w.values for w in weights]), weights[0].kind)
    values = torch.cat([w.values for w in weights]).to(device)
    dtype = torch.float32 if backend == "blocks" else dtype  # blocks keep fp16 scales exact
    scales = torch.cat([w.scales for w in weights]).to(device, dtype)
    if kinds == {"int8"}:
        return Int8WeightOnlyLinear(values, scales, group_size=GGUF_BLOCK, backend=backend)
    zeros = torch.cat([w.zeros for w in weights]).to(device, dtype)
    return Int4WeightOnlyLinear(values, scales, zeros, GGUF_BLOCK, backend=backend)


def _part_layer(weights: list[BlockWeight], dtype, device, backend: str | None) -> nn.Module:
    """One run of same-kind parts of a stacked layer. fp parts: a dense layer whose weight is
    a buffer, as the quantized parts' are (load_weights fills and checks parameters only)."""
    if weights[0].kind == "fp":
        return fixed_dense_layer(torch.cat([w.values for w in weights]).to(device, dtype))
    return fused_layer(weights, dtype, device, weights[0].kind, backend)


def fp_tensors(tensors: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The embedding, norms and output head under their HF names, as fp32."""
    for name, tensor in tensors.items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest in FP_NAMES:
                yield (
                    f"model.layers.{layer}.{FP_NAMES[rest]}",
                    torch.from_numpy(_dequantize(tensor)),
                )
        elif name in FP_NAMES:
            yield FP_NAMES[name], torch.from_numpy(_dequantize(tensor))


def _dequantize(tensor) -> np.ndarray:
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
