"""The attention backend interface: store new K/V in the pool, attend through page tables."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """One implementation per device/kernel family; the model calls `forward` per layer."""

    supports_cuda_graph: bool = False
    """Whether the runner may capture decode steps of this backend into CUDA graphs."""

    supports_tree_mask: bool = False
    """Whether `init_forward` reads `batch.tree_masks` (draft-tree verification, EAGLE3 with
    --speculative-eagle-topk > 1); the engine refuses tree drafting otherwise."""

    accepts_stored_kv: bool = False
    """Whether `forward_stored` runs: the model may write K/V itself (its fused CPU op)."""

    def __init__(
        self, pool: KVPool, sliding_window: int | None = None, logit_cap: float | None = None
    ):
        """`logit_cap`: scaled scores soft-capped to cap * tanh(score / cap) before the softmax
        (Gemma's attn_logit_softcapping); None: plain scores."""
        self.pool = pool
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap

    @abstractmethod
    def init_forward(self, batch: ForwardBatch) -> None:
        """Computes per-batch metadata once (stored on `batch.attn_metadata`), shared by layers."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

        Writes k, v into their slots of `layer`, then returns attention output
        [num_tokens, num_heads, head_dim] where each token sees its request's positions <= its own.
        """

    def forward_stored(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """`forward` for k, v that the caller has already written into their slots."""
        raise NotImplementedError(f"{type(self).__name__} writes K/V itself")

    def store_target(
        self, layer: int, batch: ForwardBatch
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Where a caller writing `layer`'s K/V itself (`forward_stored`) puts them: that
        layer's (K, V) buffers and each new token's slot in them."""
        return self.pool.layer_kv(layer), batch.out_slots

    # ---- CUDA graphs (pure decode batches of a fixed size; see model/cuda_graph.py) ---------

    def plan_graph_decode(self, batch: ForwardBatch, seq_lens: Sequence[int]) -> None:
        """Host-side planning before a decode graph is captured or replayed (outside the graph).

        `batch` holds the graph's static buffers (page_table: [bs, max_pages]); `seq_lens` are
        the host-side lengths of its rows, padding rows included. Default: nothing to plan.
        """
        return None

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        """`init_forward` for a captured decode step: runs inside the graph, so it may use only
        device ops on the static buffers (`seq_lens`: [bs]) - no host syncs, no shapes that
        depend on data - and each replay recomputes it."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
