"""Batched multi-LoRA on the Llama family's fused projections (segmented matmuls in torch).

Each adapter gets a slot; a batch's tokens are grouped by slot once per step (the batch
builder's `LoraBatch`), and every projection then adds, per slot present:

    out[rows_i] += (x[rows_i] @ A_i^T) @ B_i^T          rows_i: the tokens of adapter i

Base rows are never touched, so they are bit-identical to a run without LoRA. Our fused
projections stack PEFT's per-module weights: qkv's A is [A_q; A_k; A_v] and its B is
block-diagonal (B_q into the q columns, ...), the scale folded into B; gate_up likewise.
A module the adapter does not target contributes no rows (a projection no adapter of the
batch targets costs nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.config import ModelConfig
from radixserve.forward_batch import LoraBatch
from radixserve.model.lora_adapter import LoraAdapter, module_shape

FUSED_MODULES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""Our fused projection -> the PEFT modules stacked in it, in output-column order."""


class LoraProjection:
    """One fused projection's adapters: slot -> (A [R, in], B [out, R]), scale in B."""

    def __init__(self) -> None:
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add_to(self, out: torch.Tensor, x: torch.Tensor, lora: LoraBatch) -> None:
        """out [num_tokens, out] += each adapter's delta on its own rows, in place."""
        for slot, rows in lora.segments:
            pair = self.weights.get(slot)
            if pair is None:
                continue
            a, b = pair
            if len(lora.segments) == 1 and rows.shape[0] == x.shape[0]:  # every row: no gather
                out.add_((x @ a.t()) @ b.t())
                continue
            delta = (x.index_select(0, rows) @ a.t()) @ b.t()
            out.index_add_(0, rows, delta.to(out.dtype))


@dataclass
class LoraLayer:
    """The LoRA projections of one decoder layer."""

    qkv: LoraProjection
    o: LoraProjection
    gate_up: LoraProjection
    down: LoraProjection


class LoraWeights:
    """Every layer's LoRA projections, and which adapter holds which slot.

    Each load of an adapter gets a fresh load id, which requests carry (and their cache
    namespace holds): a request for an adapter since unloaded or reloaded from another
    folder never runs with, nor shares KV with, weights other than those it was sent for.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.config, self.dtype, self.device = config, dtype, device
        self.layers = [
            LoraLayer(*(LoraProjection() for _ in FUSED_MODULES)) for _ in range(config.num_layers)
        ]
        self.ids: dict[str, int] = {}  # adapter name -> its load id
        self.paths: dict[str, str] = {}  # adapter name -> its folder
        self.slot_of_id: dict[int, int] = {}  # load id -> slot
        self._next_id = 0

    def add(self, adapter: LoraAdapter) -> int:
        """Puts the adapter in a free slot (its weights stacked per fused projection);
        returns its load id."""
        if adapter.name in self.ids:
            raise ValueError(f"lora_name {adapter.name!r} is already loaded")
        used = set(self.slot_of_id.values())
        slot = min(set(range(len(used) + 1)) - used)
        for index, layer in enumerate(self.layers):
            for fused, modules in FUSED_MODULES.items():
                pair = self._stack(adapter, index, modules)
                if pair is not None:
                    getattr(layer, fused).weights[slot] = pair
        load_id, self._next_id = self._next_id, self._next_id + 1
        self.ids[adapter.name], self.paths[adapter.name] = load_id, adapter.path
        self.slot_of_id[load_id] = slot
        return load_id

    def remove(self, name: str) -> None:
        """Frees the adapter's slot; requests still carrying its load id are refused."""
        if name not in self.ids:
            raise ValueError(f"lora_name {name!r} is not loaded")
        slot = self.slot_of_id.pop(self.ids.pop(name))
        del self.paths[name]
        for layer in self.layers:
            for fused in FUSED_MODULES:
                getattr(layer, fused).weights.pop(slot, None)

    def _stack(self, adapter: LoraAdapter, layer: int, modules: tuple[str, ...]):
        """(A [R, in], B [out, R]) of the modules the adapter targets in this fused
        projection, B block-diagonal and scaled; None when it targets none of them."""
        outs = [module_shape(self.config, m)[1] for m in modules]
        present = [(i, adapter.weights[(layer, m)]) for i, m in enumerate(modules)
                   if (layer, m) in adapter.weights]  # fmt: skip
        if not present:
            return None
        in_features = module_shape(self.config, modules[0])[0]
        rank = adapter.rank
        a = torch.zeros(rank * len(present), in_features, dtype=torch.float32)
        b = torch.zeros(sum(outs), rank * len(present), dtype=torch.float32)
        for k, (i, (a_i, b_i)) in enumerate(present):
            start = sum(outs[:i])
            a[k * rank : (k + 1) * rank] = a_i.float()
            b[start : start + outs[i], k * rank : (k + 1) * rank] = b_i.float() * adapter.scale
        return a.to(self.device, self.dtype), b.to(self.device, self.dtype)


def load_lora_weights(
    config: ModelConfig,
    adapters: dict[str, str],
    max_rank: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraWeights:
    """Every adapter of `adapters` (name -> PEFT folder), read, checked and stacked."""
    weights = LoraWeights(config, dtype, device)
    for name, path in adapters.items():
        weights.add(LoraAdapter.load(name, path, config, max_rank))
    return weights
