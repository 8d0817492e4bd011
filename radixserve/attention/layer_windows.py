"""Hybrid attention: each decoder layer through the backend built for its sliding window.

Gemma 3 interleaves sliding-window layers with global ones, and Qwen2 with
`use_sliding_window` slides only from `max_window_layers` on. Every backend takes one window
for all layers (its masks and kernel plans are built once per batch), so a hybrid model gets
one backend per distinct window over the same pool, and this one routes each layer's call:

    layer:    0    1    2    3    4    5    6  ...      windows = (W, W, W, W, W, None, W, ...)
    backend:  [W]  [W]  [W]  [W]  [W]  [None] [W]      metadata: one per backend, per batch

Each inner backend keeps its per-batch metadata in `batch.attn_metadata`; here that field holds
all of theirs, and each call sees its own backend's for the duration of the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.forward_batch import ForwardBatch


@dataclass(frozen=True)
class _PerBackend:
    metadata: tuple[Any, ...]  # one per LayerWindowBackend.backends entry


class LayerWindowBackend(AttentionBackend):
    """Routes layer `i` to the backend of `layer_windows[i]` (None: global attention)."""

    def __init__(
        self, build: Callable[[int | None], AttentionBackend], layer_windows: Sequence[int | None]
    ):
        windows = list(dict.fromkeys(layer_windows))
        self.backends = [build(w) for w in windows]
        super().__init__(self.backends[0].pool, sliding_window=None)
        self.layer_windows = tuple(layer_windows)
        self._index = [windows.index(w) for w in layer_windows]
        self.supports_cuda_graph = all(b.supports_cuda_graph for b in self.backends)
        self.accepts_stored_kv = all(b.accepts_stored_kv for b in self.backends)

    def init_forward(self, batch: ForwardBatch) -> None:
        self._init_each(lambda backend: backend.init_forward(batch), batch)

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        self._init_each(lambda backend: backend.init_graph_decode(batch, seq_lens), batch)

    def plan_graph_decode(self, batch: ForwardBatch, seq_lens: Sequence[int]) -> None:
        for backend in self.backends:
            backend.plan_graph_decode(batch, seq_lens)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._call(layer, batch, lambda b: b.forward(q, k, v, layer, batch))

    def forward_stored(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._call(layer, batch, lambda b: b.forward_stored(q, k, v, layer, batch))

    def _init_each(self, init: Callable[[AttentionBackend], None], batch: ForwardBatch) -> None:
        metadata = []
        for backend in self.backends:
            init(backend)
            metadata.append(batch.attn_metadata)
        batch.attn_metadata = _PerBackend(tuple(metadata))

    def _call(
        self, layer: int, batch: ForwardBatch, run: Callable[[AttentionBackend], torch.Tensor]
    ) -> torch.Tensor:
        index = self._index[layer]
        shared: _PerBackend = batch.attn_metadata
        batch.attn_metadata = shared.metadata[index]
        try:
            return run(self.backends[index])
        finally:
            batch.attn_metadata = shared
