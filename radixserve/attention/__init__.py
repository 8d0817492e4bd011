"""Attention backends behind one interface (base.AttentionBackend), chosen by name.

    torch_native  plain PyTorch SDPA over gathered pages; any device; the reference
    triton        our Triton kernels (radixserve_kernels); CUDA (CPU under TRITON_INTERPRET=1)
    flashinfer    FlashInfer's kernels; CUDA only, optional dependency, imported on use

`auto` is triton on CUDA, torch_native elsewhere. FlashInfer is not the auto choice (yet):
triton is the backend the GPU device check (benchmarks/gpu/check.py) verifies end to end,
while flashinfer is an optional install whose backend has not been through a device run;
flip `default_backend` once a run with flashinfer installed shows it correct and faster.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.cache.kv_pool import KVPool

BackendFactory = Callable[[KVPool, int, "int | None"], AttentionBackend]


def _torch_native(pool: KVPool, num_heads: int, sliding_window: int | None) -> AttentionBackend:
    return TorchNativeBackend(pool, sliding_window=sliding_window)


def _triton(pool: KVPool, num_heads: int, sliding_window: int | None) -> AttentionBackend:
    from radixserve.attention.triton_backend import TritonBackend

    return TritonBackend(pool, sliding_window=sliding_window)


def _flashinfer(pool: KVPool, num_heads: int, sliding_window: int | None) -> AttentionBackend:
    from radixserve.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(pool, num_heads, sliding_window=sliding_window)


BACKENDS: dict[str, BackendFactory] = {
    "torch_native": _torch_native,
    "triton": _triton,
    "flashinfer": _flashinfer,
}


def default_backend(device: torch.device) -> str:
    """What `auto` means on `device`: triton on CUDA (when installed), torch_native elsewhere."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch_native"


def create_attention_backend(
    name: str,
    pool: KVPool,
    device: torch.device,
    sliding_window: int | None = None,
    num_heads: int | None = None,
) -> AttentionBackend:
    """Builds the backend called `name` (or `auto`); `num_heads` (query heads) for flashinfer."""
    if name == "auto":
        name = default_backend(device)
    if name not in BACKENDS:
        allowed = ", ".join(BACKENDS)
        raise ValueError(f"attention_backend must be auto or one of {allowed}; got {name!r}")
    if name == "flashinfer" and num_heads is None:
        raise ValueError("attention_backend='flashinfer' needs num_heads (the model's query heads)")
    return BACKENDS[name](pool, num_heads or 0, sliding_window)
