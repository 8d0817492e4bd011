"""Hybrid attention: each decoder layer through the backend built for its sliding window.

Gemma 3 interleaves sliding-window layers with global ones, and Qwen2 with
`use_sliding_window` slides only from `max_window_layers` on. Every backend takes one window
for all layers (its masks and kernel plans are built once per batch), so a hybrid model gets
one backend per distinct window over the same pool, and this one routes each layer's call:

    layer:    0    1    2    3    4    5    6  ...      windows = (W, W, W, W, W, None, W, ...)
    backend:  [W]  [W]  [W]  [W]  [W]  [None] [W]      metadata: one per backend, per batch

Each inner backend keeps its per-batch metadata in `batch.attn_metadata`; here that field holds
all of theirs, and each call sees its own backend's for the duration of the call.

Over a HybridKVPool (cache/swa_pool.py) the sliding backends read and write the pool's
sliding space: they get the pool's `sliding` part and a view of each batch whose page table
and out slots are translated into sliding pages, built once per batch here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch


@dataclass(frozen=True)
class _PerBackend:
    metadata: tuple[Any, ...]  # one per LayerWindowBackend.backends entry
    views: tuple[ForwardBatch | None, ...]  # the sliding space's view of the batch, or None


class LayerWindowBackend(AttentionBackend):
    """Routes layer `i` to the backend of `layer_windows[i]` (None: global attention)."""

    def __init__(
        self,
        build: Callable[[int | None, KVPool], AttentionBackend],
        layer_windows: Sequence[int | None],
        pool: KVPool,
    ):
        windows = list(dict.fromkeys(layer_windows))
        # a HybridKVPool: sliding windows over its sliding space (translated batches)
        self.hybrid = pool if pool.sliding_window is not None else None
        self._translated = [self.hybrid is not None and w is not None for w in windows]
        self.backends = [
            build(w, pool.sliding if translated else pool)
            for w, translated in zip(windows, self._translated)
        ]
        super().__init__(pool, sliding_window=None)
        self.layer_windows = tuple(layer_windows)
        self._index = [windows.index(w) for w in layer_windows]
        self.supports_cuda_graph = all(b.supports_cuda_graph for b in self.backends)
        # a draft tree's mask is the batch's (tree_masks), and each backend counts its own
        # window along the tree's paths; accepted nodes' K/V move in both spaces (copy_slots)
        self.supports_tree_mask = all(b.supports_tree_mask for b in self.backends)
        self.accepts_stored_kv = all(b.accepts_stored_kv for b in self.backends)

    def init_forward(self, batch: ForwardBatch) -> None:
        self._init_each(lambda backend, b: backend.init_forward(b), batch)

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        self._init_each(lambda backend, b: backend.init_graph_decode(b, seq_lens), batch)

    def plan_graph_decode(self, batch: ForwardBatch, seq_lens: Sequence[int]) -> None:
        for backend, translated in zip(self.backends, self._translated):
            backend.plan_graph_decode(self._view(batch) if translated else batch, seq_lens)

    def store_target(
        self, layer: int, batch: ForwardBatch
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        index = self._index[layer]
        view = batch.attn_metadata.views[index]
        if view is None:
            return self.pool.layer_kv(layer), batch.out_slots
        return self.backends[index].pool.layer_kv(layer), view.out_slots

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._call(layer, batch, lambda b, fb: b.forward(q, k, v, layer, fb))

    def forward_stored(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._call(layer, batch, lambda b, fb: b.forward_stored(q, k, v, layer, fb))

    def _init_each(
        self, init: Callable[[AttentionBackend, ForwardBatch], None], batch: ForwardBatch
    ) -> None:
        metadata, views = [], []
        for backend, translated in zip(self.backends, self._translated):
            view = self._view(batch) if translated else None
            init(backend, view or batch)
            metadata.append((view or batch).attn_metadata)
            views.append(view)
        batch.attn_metadata = _PerBackend(tuple(metadata), tuple(views))

    def _view(self, batch: ForwardBatch) -> ForwardBatch:
        """`batch` in the sliding space's pages and slots (tombstones: the scratch page)."""
        return replace(
            batch,
            page_table=self.hybrid.translate_pages(batch.page_table),
            out_slots=self.hybrid.translate_slots(batch.out_slots),
            attn_metadata=None,
        )

    def _call(
        self,
        layer: int,
        batch: ForwardBatch,
        run: Callable[[AttentionBackend, ForwardBatch], torch.Tensor],
    ) -> torch.Tensor:
        index = self._index[layer]
        shared: _PerBackend = batch.attn_metadata
        view = shared.views[index]
        if view is not None:
            return run(self.backends[index], view)
        batch.attn_metadata = shared.metadata[index]
        try:
            return run(self.backends[index], batch)
        finally:
            batch.attn_metadata = shared
