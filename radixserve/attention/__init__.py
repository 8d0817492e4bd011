"""Attention backends behind one interface (base.AttentionBackend)."""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.cache.kv_pool import KVPool

BACKENDS = {"torch_native": TorchNativeBackend}


def create_attention_backend(
    name: str, pool: KVPool, device: torch.device, sliding_window: int | None = None
) -> AttentionBackend:
    """Builds the backend called `name`; `auto` picks the best one available on `device`."""
    if name == "auto":
        name = "torch_native"
    if name not in BACKENDS:
        raise ValueError(
            f"attention_backend must be auto or one of {', '.join(BACKENDS)}; got {name!r}"
        )
    return BACKENDS[name](pool, sliding_window=sliding_window)


__all__ = ["AttentionBackend", "TorchNativeBackend", "create_attention_backend"]
