"""LoraAdapter: one PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), read
and checked against the base model it is served on.

    adapter_model.safetensors key                                       -> (layer, module)
    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in]   (3, "q_proj") A
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out, r]  (3, "q_proj") B

A projection's output gains x @ A^T @ B^T * scale, scale = lora_alpha / r (use_rslora:
lora_alpha / sqrt(r)). Everything that cannot be served exactly is refused at load, naming
--lora-paths and the adapter: other target modules, DoRA, biases, per-module ranks, a base
of other shapes, a rank above --max-lora-rank.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from radixserve.config import ModelConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (PEFT's names in the Llama family)."""
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraAdapterError(ValueError):
    """An adapter folder that cannot be served on this base model."""


@dataclass
class LoraAdapter:
    """One adapter's weights: (layer, module) -> (A [r, in], B [out, r]), and its scale."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def load(
        cls, name: str, path: str, config: ModelConfig, max_rank: int | None = None
    ) -> LoraAdapter:
        """Reads and checks the folder; LoraAdapterError naming --lora-paths if it does not fit."""
        settings = _read_config(name, path)
        rank, scale = _rank_and_scale(name, settings, max_rank)
        tensors = _read_tensors(name, path)
        weights = _pair_weights(name, tensors, config, rank)
        return cls(name=name, path=path, rank=rank, scale=scale, weights=weights)

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a Llama-family projection, unsharded."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def _fail(name: str, message: str) -> LoraAdapterError:
    return LoraAdapterError(f"--lora-paths adapter {name!r}: {message}")


def _read_config(name: str, path: str) -> dict:
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise _fail(name, f"{config_path} not found (a PEFT adapter folder is needed)")
    with open(config_path) as f:
        settings = json.load(f)
    if settings.get("peft_type", "LORA") != "LORA":
        raise _fail(name, f"peft_type {settings.get('peft_type')!r} is not LORA")
    targets = settings.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(set(targets) - set(LORA_MODULES))
    if unknown:
        allowed = ", ".join(LORA_MODULES)
        raise _fail(name, f"target modules {unknown} are not supported (only {allowed})")
    unsupported = {
        "use_dora": settings.get("use_dora"),
        "fan_in_fan_out": settings.get("fan_in_fan_out"),
        "rank_pattern": settings.get("rank_pattern"),
        "alpha_pattern": settings.get("alpha_pattern"),
        "modules_to_save": settings.get("modules_to_save"),
    }
    for key, value in unsupported.items():
        if value:
            raise _fail(name, f"{key} = {value!r} is not supported")
    if settings.get("bias", "none") != "none":
        raise _fail(name, f"bias = {settings['bias']!r} is not supported (only 'none')")
    return settings


def _rank_and_scale(name: str, settings: dict, max_rank: int | None) -> tuple[int, float]:
    rank = settings.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _fail(name, f"r must be a positive int; got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise _fail(name, f"rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = settings.get("lora_alpha", rank)
    root = math.sqrt(rank) if settings.get("use_rslora") else rank
    return rank, float(alpha) / root


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise _fail(name, f"{weights_path} not found (only safetensors adapters are read)")
    return load_file(weights_path)


def _pair_weights(
    name: str, tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B), every key and shape checked against the base model."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in LORA_MODULES:
            raise _fail(name, f"tensor {key!r} is not a LoRA weight of {LORA_MODULES}")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if layer >= config.num_layers:
            raise _fail(name, f"tensor {key!r}: the base model has {config.num_layers} layers")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise _fail(name, "adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise _fail(name, f"layer {layer} {module} lacks its lora_A or lora_B weight")
        _check_shapes(name, layer, module, pair["A"], pair["B"], config, rank)
        weights[(layer, module)] = (pair["A"], pair["B"])
    return weights


def _check_shapes(name, layer, module, a, b, config: ModelConfig, rank: int) -> None:
    in_features, out_features = module_shape(config, module)
    expected = {"A": (rank, in_features), "B": (out_features, rank)}
    for half, tensor in (("A", a), ("B", b)):
        if tuple(tensor.shape) != expected[half]:
            raise _fail(
                name,
                f"layer {layer} {module}.lora_{half} has shape {tuple(tensor.shape)}, expected "
                f"{expected[half]}: an adapter of another base model, or another rank",
            )
