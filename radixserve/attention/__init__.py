"""Attention backends behind one interface (base.AttentionBackend), chosen by name.

    torch_native  plain PyTorch SDPA over gathered pages; any device; the reference
    cpu_fused     torch_native with decode and cached-prefix extends by C++ kernels reading
                  pages in place; CPU only, built on first use (radixserve/native)
    triton        our Triton kernels (radixserve_kernels); CUDA (CPU under TRITON_INTERPRET=1)
    flashinfer    FlashInfer's kernels; CUDA only, optional dependency, imported on use

`deterministic` (--enable-deterministic-inference) makes cpu_fused run every query through
its extend kernel (batch-invariant attention, see cpu_fused.py); no other backend has such a
mode, so under it they log that attention is not batch-invariant.

A hybrid model (sliding and global layers: Gemma 3, Qwen2 with max_window_layers) gets one
backend per window behind `LayerWindowBackend` (layer_windows.py): `create_model_attention`.

`auto` is triton on CUDA, cpu_fused on CPU; where the C++ kernels cannot be built (no
compiler, failed build) or read the pool's dtype, auto logs why and uses torch_native.
FlashInfer is not the auto choice (yet): triton is the backend the GPU device check
(benchmarks/gpu/check.py) verifies end to end, while flashinfer is an optional install whose
backend has not been through a device run; flip `default_backend` once a run with
flashinfer installed shows it correct and faster.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.layer_windows import LayerWindowBackend
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.native.extension import CpuExtensionUnavailable

logger = logging.getLogger(__name__)

BackendFactory = Callable[[KVPool, int, "int | None", "float | None"], AttentionBackend]


def _torch_native(
    pool: KVPool, num_heads: int, sliding_window: int | None, logit_cap: float | None
) -> AttentionBackend:
    return TorchNativeBackend(pool, sliding_window=sliding_window, logit_cap=logit_cap)


def _cpu_fused(
    pool: KVPool,
    num_heads: int,
    sliding_window: int | None,
    logit_cap: float | None,
    deterministic: bool = False,
) -> AttentionBackend:
    from radixserve.attention.cpu_fused import CpuFusedBackend

    try:
        return CpuFusedBackend(
            pool, sliding_window=sliding_window, logit_cap=logit_cap, deterministic=deterministic
        )
    except CpuExtensionUnavailable as exc:
        raise RuntimeError(
            f"attention_backend='cpu_fused': {exc}; use attention_backend='torch_native'"
        ) from exc


def _triton(
    pool: KVPool, num_heads: int, sliding_window: int | None, logit_cap: float | None
) -> AttentionBackend:
    from radixserve.attention.triton_backend import TritonBackend

    return TritonBackend(pool, sliding_window=sliding_window, logit_cap=logit_cap)


def _flashinfer(
    pool: KVPool, num_heads: int, sliding_window: int | None, logit_cap: float | None
) -> AttentionBackend:
    from radixserve.attention.flashinfer_backend import FlashInferBackend

    if logit_cap is not None:
        raise ValueError(
            "attention_backend='flashinfer' does not soft-cap attention scores "
            "(attn_logit_softcapping) here; use --attention-backend triton"
        )
    return FlashInferBackend(pool, num_heads, sliding_window=sliding_window)


BACKENDS: dict[str, BackendFactory] = {
    "torch_native": _torch_native,
    "cpu_fused": _cpu_fused,
    "triton": _triton,
    "flashinfer": _flashinfer,
}

KV_CASTING_BACKENDS = ("torch_native", "cpu_fused")
"""Backends that read a pool whose dtype differs from the model's, casting as they read."""


def default_backend(device: torch.device) -> str:
    """What `auto` means on `device`: triton on CUDA (when installed), cpu_fused on CPU,
    torch_native elsewhere (create_attention_backend may still fall back from cpu_fused)."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "cpu_fused" if device.type == "cpu" else "torch_native"


def create_attention_backend(
    name: str,
    pool: KVPool,
    device: torch.device,
    sliding_window: int | None = None,
    num_heads: int | None = None,
    deterministic: bool = False,
    logit_cap: float | None = None,
) -> AttentionBackend:
    """Builds the backend called `name` (or `auto`); `num_heads` (query heads) for flashinfer;
    `deterministic`: batch-invariant attention where the backend has it (cpu_fused);
    `logit_cap`: scores soft-capped (AttentionBackend)."""
    if name == "auto":
        name = default_backend(device)
        if name == "cpu_fused":
            return _cpu_fused_or_reference(pool, sliding_window, logit_cap, deterministic)
    if name not in BACKENDS:
        allowed = ", ".join(BACKENDS)
        raise ValueError(f"attention_backend must be auto or one of {allowed}; got {name!r}")
    if name == "flashinfer" and num_heads is None:
        raise ValueError("attention_backend='flashinfer' needs num_heads (the model's query heads)")
    if name == "cpu_fused":
        return _cpu_fused(pool, num_heads or 0, sliding_window, logit_cap, deterministic)
    if deterministic:
        _warn_not_invariant(name)
    return BACKENDS[name](pool, num_heads or 0, sliding_window, logit_cap)


def create_model_attention(
    name: str,
    pool: KVPool,
    device: torch.device,
    layer_windows: Sequence[int | None],
    num_heads: int | None = None,
    deterministic: bool = False,
    logit_cap: float | None = None,
) -> AttentionBackend:
    """`create_attention_backend` for a model whose layer i attends within `layer_windows[i]`
    (None: globally): one backend when all layers agree, else one per window, routed by layer
    (always so over a HybridKVPool, whose sliding layers read its second page space)."""

    def build(window: int | None, space: KVPool) -> AttentionBackend:
        return create_attention_backend(
            name, space, device, window, num_heads, deterministic, logit_cap
        )

    if len(set(layer_windows)) == 1 and pool.sliding_window is None:
        return build(layer_windows[0], pool)
    return LayerWindowBackend(build, layer_windows, pool)


def _warn_not_invariant(name: str) -> None:
    logger.warning(
        "--enable-deterministic-inference: the %s attention backend is not batch-invariant "
        "(only cpu_fused is); greedy output may still depend on batching and speculation",
        name,
    )


def _cpu_fused_or_reference(
    pool: KVPool, sliding_window: int | None, logit_cap: float | None, deterministic: bool
) -> AttentionBackend:
    """`auto` on CPU: the fused decode kernel when it builds and reads this pool's dtype, else
    the reference, saying why in one log line."""
    from radixserve.attention.cpu_fused import KV_DTYPES, CpuFusedBackend

    if pool.dtype not in KV_DTYPES:
        logger.info("attention: torch_native (cpu_fused reads no %s K/V)", pool.dtype)
        return _reference(pool, sliding_window, logit_cap, deterministic)
    try:
        return CpuFusedBackend(
            pool, sliding_window=sliding_window, logit_cap=logit_cap, deterministic=deterministic
        )
    except CpuExtensionUnavailable as exc:
        logger.warning("attention: torch_native, %s", str(exc).splitlines()[0])
        return _reference(pool, sliding_window, logit_cap, deterministic)


def _reference(
    pool: KVPool, sliding_window: int | None, logit_cap: float | None, deterministic: bool
) -> AttentionBackend:
    if deterministic:
        _warn_not_invariant("torch_native")
    return TorchNativeBackend(pool, sliding_window=sliding_window, logit_cap=logit_cap)
