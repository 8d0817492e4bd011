"""llama.cpp's GGUF layout of mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral).

    general.architecture    qwen3moe | qwen2moe | llama with llama.expert_count (Mixtral)
    {arch}.expert_count / expert_used_count        num_experts / num_experts_per_tok
    {arch}.expert_feed_forward_length              moe_intermediate_size (Qwen; Mixtral's
                                                   experts are feed_forward_length wide)
    {arch}.expert_shared_feed_forward_length       Qwen2-MoE's shared expert
    {arch}.expert_weights_norm                     norm_topk_prob (absent: llama.cpp's default
                                                   per arch: qwen3moe and Mixtral renormalize)

    GGUF tensor (layer N)                 numpy shape            ours
    blk.N.ffn_gate_inp.weight             [E, hidden]            mlp.gate (the router, fp)
    blk.N.ffn_{gate,up}_exps.weight       [E, inter, hidden]     mlp.w13[e] rows / expert layers
    blk.N.ffn_down_exps.weight            [E, hidden, inter]     mlp.w2[e] / expert layers
    blk.N.ffn_{gate,up,down}_shexp.weight                        mlp.shared_expert (GatedMLP)
    blk.N.ffn_gate_inp_shexp.weight       [hidden]               mlp.shared_expert_gate [1, hidden]

A layer without ffn_gate_inp is dense (its ffn_gate / ffn_up / ffn_down, as a llama layer).
Experts stored fp fill the stacked fp parameters; stored as blocks (Q4_0 / Q4_1 / Q8_0 /
K-quants), each of this rank's experts becomes a gate_up and a down layer on the block kernels
(`SparseMoeBlock.use_expert_layers`), the file's blocks as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from radixserve.model.gguf_file import GGUFTensor
from radixserve.model.quant.base_linear import fixed_dense_layer
from radixserve.model.quant.gguf_blocks import FP_TYPES
from radixserve.model.source import ModelLoadError

MOE_ARCHITECTURES = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
GGUF_ARCHITECTURES = ("llama", *MOE_ARCHITECTURES)  # what our GGUF reader builds models of
_RENORMALIZES = {"qwen2moe": False, "qwen3moe": True, "llama": True}  # llama.cpp's defaults
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED_PARTS = {  # GGUF part -> the shared expert's HF part
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def is_moe_gguf(reader) -> bool:
    """True for a Qwen2-MoE / Qwen3-MoE GGUF, or a llama one with experts (Mixtral)."""
    arch = reader.fields.get("general.architecture")
    return arch in MOE_ARCHITECTURES or (
        arch == "llama" and bool(reader.fields.get("llama.expert_count"))
    )


def moe_hf_fields(reader, arch: str, names: set[str], num_layers: int) -> dict[str, Any]:
    """The HF config fields of an MoE GGUF (architectures, experts, routing); {} for a dense
    llama file."""
    fields = reader.fields
    num_experts = fields.get(f"{arch}.expert_count") or 0
    if not num_experts:
        return {}
    gating = fields.get(f"{arch}.expert_gating_func", _SOFTMAX_GATING)
    if gating != _SOFTMAX_GATING:
        raise ModelLoadError(
            f"GGUF {arch}: expert_gating_func {gating} is not softmax; only softmax routing "
            "(transformers' Qwen-MoE / Mixtral) is implemented"
        )
    out = {
        "num_experts_per_tok": fields.get(f"{arch}.expert_used_count"),
        "norm_topk_prob": bool(fields.get(f"{arch}.expert_weights_norm", _RENORMALIZES[arch])),
    }
    if arch == "llama":  # Mixtral: every layer routed, experts feed_forward_length wide
        return out | {"architectures": ["MixtralForCausalLM"], "num_local_experts": num_experts}
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    out |= {
        "architectures": [MOE_ARCHITECTURES[arch]],
        "num_experts": num_experts,
        "moe_intermediate_size": fields.get(f"{arch}.expert_feed_forward_length"),
        "mlp_only_layers": dense,
        "decoder_sparse_step": 1,
        "qkv_bias": "blk.0.attn_q.bias" in names,
        "shared_expert_intermediate_size": fields.get(
            f"{arch}.expert_shared_feed_forward_length", 0
        ),
    }
    if out["moe_intermediate_size"] is None:
        raise ModelLoadError(f"GGUF {arch} has no {arch}.expert_feed_forward_length")
    return out


def expert_slice(tensor: GGUFTensor, expert: int) -> GGUFTensor:
    """One expert's 2-D weight of a stacked [E, rows, cols] GGUF tensor (a view of the mapped
    file, its offset the expert's: K-quant blocks stay the file's pages, gguf_blocks.py)."""
    data = tensor.data[expert]
    return dataclasses.replace(
        tensor,
        name=f"{tensor.name}[{expert}]",
        shape=tensor.shape[:2].copy(),
        data=data,
        offset=tensor.offset + expert * data.nbytes,
    )


class Builders(NamedTuple):
    """gguf_weights' own decoders, handed in (it imports this module)."""

    decode: Callable[[GGUFTensor], Any]  # tensor -> BlockWeight (blocks, or fp values)
    fused: Callable[[list, str], nn.Module | None]  # BlockWeights -> one layer; None: all fp
    dequant: Callable[[GGUFTensor], np.ndarray]  # tensor -> fp32 values


def load_moe_layer(
    model: nn.Module, tensors: dict, layer: int, build: Builders
) -> list[tuple[str, torch.Tensor]]:
    """Fills layer `layer`'s routed MLP: quantized experts become expert layers here; returns
    the HF-named fp tensors for `load_weights` (router, fp experts, fp shared expert parts)."""
    mlp, prefix, block = model.layers[layer].mlp, f"model.layers.{layer}.mlp", f"blk.{layer}"
    fp = [(f"{prefix}.gate.weight", _fp(build, _tensor(tensors, f"{block}.ffn_gate_inp")))]
    if f"{block}.ffn_gate_inp_shexp.weight" in tensors:
        gate = _fp(build, tensors[f"{block}.ffn_gate_inp_shexp.weight"]).reshape(1, -1)
        fp.append((f"{prefix}.shared_expert_gate.weight", gate))
    fp += _shared_expert(mlp, tensors, layer, build)
    stacked = [_tensor(tensors, f"{block}.{part}") for part in EXPERT_PARTS]
    if all(t.tensor_type.name in FP_TYPES for t in stacked):
        for tensor, name in zip(stacked, ("gate_proj", "up_proj", "down_proj")):
            values = _fp(build, tensor)
            fp += [(f"{prefix}.experts.{e}.{name}.weight", values[e]) for e in range(len(values))]
        return fp
    gate_up, down = [], []
    first, local = mlp.first_expert, mlp.w13.shape[0]
    dtype, device = mlp.w13.dtype, mlp.w13.device
    for e in range(first, first + local):
        gate, up, down_w = (build.decode(expert_slice(t, e)) for t in stacked)
        what = f"{block} expert {e}"
        gate_up.append(_expert_layer(build, [gate, up], f"{what} gate/up", dtype, device))
        down.append(_expert_layer(build, [down_w], f"{what} down", dtype, device))
    mlp.use_expert_layers(gate_up, down)
    return fp


def _expert_layer(build: Builders, weights: list, what: str, dtype, device) -> nn.Module:
    """One expert's layer: its blocks' kernel layer, or a fixed dense layer if stored fp."""
    module = build.fused(weights, what=what)
    if module is None:
        return fixed_dense_layer(torch.cat([w.values for w in weights]).to(device, dtype))
    return module


def _shared_expert(mlp: nn.Module, tensors: dict, layer: int, build: Builders) -> list:
    """Qwen2-MoE's shared expert: quantized parts become its layers, fp ones HF tensors."""
    block, fp = f"blk.{layer}", []
    if f"{block}.ffn_gate_shexp.weight" not in tensors:
        return fp
    for attr, parts in (("gate_up_proj", _SHARED_GATE_UP), ("down_proj", ("ffn_down_shexp",))):
        weights = [build.decode(_tensor(tensors, f"{block}.{part}")) for part in parts]
        module = build.fused(weights, what=f"{block}: shared expert {attr}")
        if module is None:
            names = [f"model.layers.{layer}.{SHARED_PARTS[p]}.weight" for p in parts]
            fp += [(name, w.values) for name, w in zip(names, weights)]
        else:
            setattr(mlp.shared_expert, attr, module)
    return fp


_SHARED_GATE_UP = ("ffn_gate_shexp", "ffn_up_shexp")


def _tensor(tensors: dict, name: str) -> GGUFTensor:
    if f"{name}.weight" not in tensors:
        raise ModelLoadError(f"GGUF file is missing tensor {name}.weight")
    return tensors[f"{name}.weight"]


def _fp(build: Builders, tensor: GGUFTensor) -> torch.Tensor:
    return torch.from_numpy(build.dequant(tensor))
