"""Batched multi-LoRA on the Llama family's fused projections (grouped matmuls in torch).

Each adapter gets a slot; a batch's tokens are grouped by slot once per step (the batch
builder's `LoraBatch`), and every projection then adds, per slot present:

    out[rows_i] += (x[rows_i] @ A_i^T) @ B_i^T          rows_i: the tokens of adapter i

Base rows are never touched, so they are bit-identical to a run without LoRA. Our fused
projections stack PEFT's per-module weights: qkv's A is [A_q; A_k; A_v] and its B is
block-diagonal (B_q into the q columns, ...), the scale folded into B; gate_up likewise.
The adapter rows are gathered once per projection, grouped by slot (one shrink and one
expand matmul per slot on a contiguous group) and scattered back once; a module an adapter
does not target adds zeros to its rows (a projection no adapter of the batch targets costs
nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.config import ModelConfig
from radixserve.forward_batch import LoraBatch
from radixserve.model.lora_adapter import LoraAdapter, module_shape
from radixserve.model.lora_segments import LoraKernel, StackedLora, stack_slots

FUSED_MODULES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""Our fused projection -> the PEFT modules stacked in it, in output-column order."""


class LoraProjection:
    """One fused projection's adapters: slot -> (A [R, in], B [out, R]), scale in B; and,
    with a `kernel` (lora_segments.py), the same slots stacked for it, made on first use
    after a change."""

    def __init__(self) -> None:
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kernel: LoraKernel | None = None
        self._stacked: StackedLora | None = None

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        self.weights[slot] = (a, b)
        self._stacked = None

    def drop(self, slot: int) -> None:
        if self.weights.pop(slot, None) is not None:
            self._stacked = None

    def add_to(self, out: torch.Tensor, x: torch.Tensor, lora: LoraBatch) -> None:
        """out [num_tokens, out] += each adapter's delta on its own rows, in place: on the
        segmented kernel where `kernel.takes` the batch, else the adapter rows gathered once
        (grouped by slot), one shrink and one expand matmul per slot on its contiguous group,
        the deltas added back in one scatter."""
        pairs = [(self.weights.get(slot), start, end) for slot, start, end in lora.segments]
        if all(pair is None for pair, _, _ in pairs):
            return
        if self.kernel is not None and self.kernel.takes(x, out, lora):
            if self._stacked is None:
                self._stacked = stack_slots(self.weights)
            self.kernel.add(out, x, lora, self._stacked)
            return
        if lora.every_row:  # one adapter on every row, in order: no gather
            a, b = pairs[0][0]
            out.add_((x @ a.t()) @ b.t())
            return
        grouped = x.index_select(0, lora.rows)
        delta = grouped.new_zeros(grouped.shape[0], out.shape[1])
        for pair, start, end in pairs:
            if pair is not None:  # an adapter not targeting this projection adds nothing
                a, b = pair
                torch.matmul(grouped[start:end] @ a.t(), b.t(), out=delta[start:end])
        out.index_add_(0, lora.rows, delta.to(out.dtype))


@dataclass
class LoraLayer:
    """The LoRA projections of one decoder layer."""

    qkv: LoraProjection
    o: LoraProjection
    gate_up: LoraProjection
    down: LoraProjection


class LoraWeights:
    """Every held adapter's weights, and the pool of `num_slots` slots the forward reads.

    Adapters are held stacked on the host (--max-loaded-loras bounds how many); a batch's
    adapters are put in pool slots first (`activate`), a full pool giving up, per `policy`
    (lru / fifo, --lora-eviction-policy), a slot whose adapter no running request uses. On
    the CPU a slot refers to the held tensors; on an accelerator it holds a copy.

    Each load of an adapter gets a fresh load id, which requests carry (and their cache
    namespace holds): a request for an adapter since unloaded or reloaded from another
    folder never runs with, nor shares KV with, weights other than those it was sent for.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        num_slots: int = 8,
        policy: str = "lru",
    ):
        self.config, self.dtype, self.device = config, dtype, device
        self.num_slots, self.policy = num_slots, policy
        self.layers = [
            LoraLayer(*(LoraProjection() for _ in FUSED_MODULES)) for _ in range(config.num_layers)
        ]
        self.ids: dict[str, int] = {}  # adapter name -> its load id
        self.paths: dict[str, str] = {}  # adapter name -> its folder
        self.held: dict[int, list[dict[str, tuple]]] = {}  # load id -> per layer {fused: (A, B)}
        self.slot_of_id: dict[int, int] = {}  # load id -> pool slot, of the adapters in the pool
        self.pool_loads = 0  # adapters put in a pool slot, ever
        self.evictions = 0  # adapters that gave their slot to another
        self._stamp: dict[int, int] = {}  # load id in the pool -> last use (lru) / entry (fifo)
        self._clock = 0
        self._next_id = 0

    def use_kernel(self, kernel: LoraKernel | None) -> None:
        """Every projection adds its deltas on `kernel` where it takes a batch (None: torch's
        grouped matmuls always)."""
        for layer in self.layers:
            for fused in FUSED_MODULES:
                getattr(layer, fused).kernel = kernel

    def add(self, adapter: LoraAdapter) -> int:
        """Holds the adapter (its weights stacked per fused projection); returns its load id.
        It enters a pool slot when a batch first needs it."""
        if adapter.name in self.ids:
            raise ValueError(f"lora_name {adapter.name!r} is already loaded")
        stacked = []
        for index in range(len(self.layers)):
            pairs = {fused: self._stack(adapter, index, modules)
                     for fused, modules in FUSED_MODULES.items()}  # fmt: skip
            stacked.append({fused: pair for fused, pair in pairs.items() if pair is not None})
        load_id, self._next_id = self._next_id, self._next_id + 1
        self.ids[adapter.name], self.paths[adapter.name] = load_id, adapter.path
        self.held[load_id] = stacked
        return load_id

    def remove(self, name: str) -> None:
        """Drops the adapter (and its pool slot); requests still carrying its load id are
        refused."""
        if name not in self.ids:
            raise ValueError(f"lora_name {name!r} is not loaded")
        load_id = self.ids.pop(name)
        del self.paths[name], self.held[load_id]
        if load_id in self.slot_of_id:
            self._evict(load_id)

    def activate(self, needed: set[int], in_use: set[int]) -> None:
        """Puts every adapter of `needed` (load ids of one batch) in a pool slot. A full pool
        gives up the slot of an adapter outside `in_use` (the running requests' adapters),
        the least recently used (lru) or the first put in (fifo)."""
        self._clock += 1
        for load_id in sorted(needed):
            if load_id not in self.slot_of_id:
                self._put_in_pool(load_id, needed | in_use)
            if self.policy == "lru" or load_id not in self._stamp:
                self._stamp[load_id] = self._clock

    def _put_in_pool(self, load_id: int, keep: set[int]) -> None:
        used = set(self.slot_of_id.values())
        if len(used) >= self.num_slots:
            idle = [i for i in self.slot_of_id if i not in keep]
            if not idle:  # admission keeps a batch's adapters within the pool: a bug
                raise RuntimeError(
                    f"LoRA pool full: {self.num_slots} slots (--max-loras-per-batch) all in use"
                )
            slot = self._evict(min(idle, key=lambda i: self._stamp[i]))
            self.evictions += 1
        else:
            slot = min(set(range(self.num_slots)) - used)
        for layer, pairs in zip(self.layers, self.held[load_id]):
            for fused, (a, b) in pairs.items():
                getattr(layer, fused).put(slot, a.to(self.device), b.to(self.device))
        self.slot_of_id[load_id] = slot
        self.pool_loads += 1

    def _evict(self, load_id: int) -> int:
        """Empties the adapter's pool slot; returns the slot."""
        slot = self.slot_of_id.pop(load_id)
        self._stamp.pop(load_id, None)
        for layer in self.layers:
            for fused in FUSED_MODULES:
                getattr(layer, fused).drop(slot)
        return slot

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
        return a.to(self.dtype), b.to(self.dtype)  # held on the host; activate() places it


def load_lora_weights(
    config: ModelConfig,
    adapters: dict[str, str],
    max_rank: int | None,
    dtype: torch.dtype,
    device: torch.device,
    num_slots: int = 8,
    policy: str = "lru",
    kernel: LoraKernel | None = None,
) -> LoraWeights:
    """Every adapter of `adapters` (name -> PEFT folder), read, checked and stacked; a pool
    of `num_slots` slots evicting per `policy` (LoraWeights), adding on `kernel`."""
    weights = LoraWeights(config, dtype, device, num_slots, policy)
    weights.use_kernel(kernel)
    for name, path in adapters.items():
        weights.add(LoraAdapter.load(name, path, config, max_rank))
    return weights
