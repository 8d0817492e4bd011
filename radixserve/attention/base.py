"""The attention backend interface: store new K/V in the pool, attend through page tables."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """One implementation per device/kernel family; the model calls `forward` per layer."""

    def __init__(self, pool: KVPool, sliding_window: int | None = None):
        self.pool = pool
        self.sliding_window = sliding_window

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
