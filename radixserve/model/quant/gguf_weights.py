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
F32 / F16 / BF16 projections stay fp. Norms are fp by design and are dequantized; so are the
embedding and the LM head (tied: the embedding; untied: output.weight), unless the layers use the
C++ "blocks" kernels (block_matmul.py): then a Q4_0 / Q4_1 / Q8_0 / K-quant head is kept as its
blocks too (the default model's tied Q8_0 head: 32 MiB read per token instead of 113 MiB), and so
is the embedding (block_embedding.py: each lookup dequantizes its tokens' rows; tied, from the
head's own layer). K-quant blocks are views of the mapped file (gguf_blocks.py). llama.cpp stores
q and k rows permuted for its RoPE layout; they are permuted back here (codes and scales alike; a
K-quant layer reorders its outputs instead). The `llama` GGUF architecture (Llama, Mistral,
SmolLM, ...) and the MoE ones (qwen3moe, qwen2moe, llama with experts: Mixtral; their experts in
gguf_moe.py) are read this way; anything else: `--quantization none`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from radixserve.config import ModelConfig
from radixserve.model.quant.block_embedding import BlockEmbedding
from radixserve.model.quant.gguf_blocks import (
    AS_IS_TYPES,
    FP_TYPES,
    BlockWeight,
    decode_block_weight,
    dequantize_tensor,
    fused_layer,
)
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
from radixserve.model.quant.kquant import KQUANT_TYPES
from radixserve.model.quant.stacked_linear import StackedLinear
from radixserve.model.source import ModelLoadError

logger = logging.getLogger(__name__)

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
    build = Builders(decode, fused, dequantize_tensor)
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
    embedding = block_embedding(tensors, head, model, layout) if blocks else None
    if embedding is not None:  # no fp table: each lookup dequantizes its rows
        tensors.pop("token_embd.weight")
        model.embed_tokens = embedding
    if head is not None:  # before the fp weights: an untied head's fp parameter goes
        tensors.pop("output.weight", None)  # not loaded as fp (absent when tied)
        model.lm_head = head  # tied: the embedding's table too (block_embedding)
    fp = fp_tensors(tensors)
    if layout is not None:  # fp projections are cut already
        fp = ((name, layout.select(name, tensor)) for name, tensor in fp)
    model.load_weights([*fp_weights, *fp])


def block_embedding(
    tensors: dict, head: nn.Module | None, model: nn.Module, layout=None
) -> BlockEmbedding | None:
    """The embedding over token_embd's blocks (block_embedding.py) if the file stores it as
    Q4_0 / Q4_1 / Q8_0 or a K-quant: tied, the head's layer itself; else None (fp table)."""
    tensor = tensors["token_embd.weight"]
    if tensor.tensor_type.name not in (*AS_IS_TYPES, *KQUANT_TYPES):
        return None
    old = model.embed_tokens
    dtype, device = old.weight.dtype, old.weight.device
    if "output.weight" not in tensors and head is not None:  # tied: the head is token_embd
        table = head
    else:
        weight = shard_head(decode_block_weight(tensor, kquants=True), layout)
        table = fused_layer([weight], dtype, device, tensor.name, "blocks")
    return BlockEmbedding(table, old.vocab_start, old.tp, dtype)


def _biases(tensors: dict, layer: int, parts, names, layout) -> list[tuple[str, torch.Tensor]]:
    """The HF-named fp32 biases of one fused projection's parts (Qwen2's q / k / v), this
    rank's part of each; [] when the file has none."""
    found = []
    for part, name in zip(parts, names):
        if (tensor := tensors.get(f"blk.{layer}.{part}.bias")) is not None:
            bias_name, values = name.removesuffix("weight") + "bias", dequantize_tensor(tensor)
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
    reason = f"its projections ({types}) are not all Q4_0/Q4_1/Q8_0/IQ4_NL/Q4_K/Q5_K/Q6_K/fp"
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
        order = unpermute_index(len(weight.values), heads)
        if weight.kind in KQUANT_TYPES:  # the mapped bytes stay as they lie
            return weight._replace(row_order=order)
        weight = weight.take_rows(order)
    return weight


def unpermute_index(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: per head, rows (2, half) were
    stored as (half, 2)."""
    rows = torch.arange(num_rows).reshape(num_heads, num_rows // num_heads // 2, 2)
    return rows.transpose(1, 2).reshape(-1)


def decode_weight(tensor, kquants: bool = False, dequantize: bool = False) -> BlockWeight:
    """`decode_block_weight`, or (`dequantize`) the tensor's fp32 values whatever its type."""
    if dequantize:
        return BlockWeight("fp", torch.from_numpy(dequantize_tensor(tensor)))
    return decode_block_weight(tensor, kquants)


def fp_tensors(tensors: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The embedding, norms and output head under their HF names, as fp32."""
    for name, tensor in tensors.items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest in FP_NAMES:
                yield (
                    f"model.layers.{layer}.{FP_NAMES[rest]}",
                    torch.from_numpy(dequantize_tensor(tensor)),
                )
        elif name in FP_NAMES:
            yield FP_NAMES[name], torch.from_numpy(dequantize_tensor(tensor))
