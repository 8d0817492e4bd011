"""Attention backends behind one interface (base.AttentionBackend)."""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.cache.kv_pool import KVPool

BACKENDS = ("torch_native", "triton")


def create_attention_backend(
    name: str, pool: KVPool, device: torch.device, sliding_window: int | None = None
) -> AttentionBackend:
    """Builds the backend called `name`; `auto` is triton on CUDA, torch_native elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _has_triton() else "torch_native"
    if name not in BACKENDS:
        allowed = ", ".join(BACKENDS)
        raise ValueError(f"attention_backend must be auto or one of {allowed}; got {name!r}")
    if name == "triton":
        from radixserve.attention.triton_backend import TritonBackend

        return TritonBackend(pool, sliding_window=sliding_window)
    return TorchNativeBackend(pool, sliding_window=sliding_window)


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
