"""The KV pool (CacheConfig) and the hierarchical cache's tier below it (HiCacheConfig)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from radixserve.config.field_types import flag_of
from radixserve.config.kv_events import KVEventsConfig
from radixserve.config.load import DTYPE_NAMES, dtype_named

if TYPE_CHECKING:
    import torch

ATTENTION_BACKENDS = ("auto", "torch_native", "cpu_fused", "triton", "flashinfer")
"""--attention-backend's choices (attention/__init__.py builds each)."""
MAX_CAPTURED_BS = 4096
"""Most of --cuda-graph-max-bs / --torch-compile-max-bs: a graph (a compiled step) and its
buffers for each of 1, 2, 4, 8, then every 8 sizes up to it (516 at 4096); 10**6 was 125k
captures, 10**30 an OverflowError at start."""
CPU_KV_MEMORY_FRACTION = 0.4
"""Of the memory available after the weights load: the CPU KV pool's default share (the rest
stays for activations, the tokenizer, the page cache and the machine's other processes)."""


@dataclass
class CacheConfig:
    """The paged KV pool and how the model runner reads it (attention backend, CUDA graphs)."""

    page_size: int = 16
    """Tokens per KV page. 16 keeps page tables and radix nodes small and suits GPU kernels."""
    max_total_tokens: int | None = None
    """KV pool capacity in tokens; default: sized from the memory budget."""
    mem_fraction_static: float = 0.85
    """On CUDA: fraction of GPU memory for weights + KV pool (+ CUDA graphs, estimated), in
    (0, 1]."""
    cpu_kv_cache_gb: float | None = None
    """On CPU: GiB of RAM for the KV pool when --max-total-tokens is not given; default:
    CPU_KV_MEMORY_FRACTION of the memory available once the weights are loaded (within the
    cgroup's limit), shared by the TP ranks, logged (as --mem-fraction-static on CUDA)."""
    attention_backend: str = "auto"
    """auto (triton on CUDA, cpu_fused on CPU, torch_native if it cannot build) | torch_native
    (reference, any device) | cpu_fused (C++ paged decode, CPU; built on first use) | triton |
    flashinfer (CUDA, needs `pip install flashinfer-python`)."""
    disable_cuda_graph: bool = False
    """On CUDA: run decode steps eagerly instead of replaying captured CUDA graphs."""
    cuda_graph_max_bs: int = 256
    """Largest decode batch captured as a CUDA graph (at most 4096); larger batches run
    eagerly."""
    enable_torch_compile: bool = False
    """On CPU (cpu_fused attention): run decode steps compiled by torch.compile (inductor),
    one static shape per padded batch size, each compiled on first use (seconds to a minute;
    inductor caches the code on disk). Falls back to eager, with a log line, where compiling
    fails. Off by default: see docs/performance.md for what it gains."""
    torch_compile_max_bs: int = 32
    """Largest decode batch run compiled (sizes 1, 2, 4, 8, then every 8; at most 4096); larger
    batches run eagerly. SGLang's default."""
    kv_cache_dtype: str = "auto"
    """auto (the model's --dtype) | float32 | bfloat16 | float16. One other than the model's
    dtype needs --attention-backend torch_native or cpu_fused, which cast K/V as they read."""
    kv_events_config: str | None = None
    """KV cache events for KV-aware routers, the flag vLLM and SGLang use: JSON such as
    '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": ""}'. BlockStored /
    BlockRemoved / AllBlocksCleared in vLLM's wire format over a ZMQ PUB socket (needs
    pyzmq: the kv-events extra), bound on tcp://127.0.0.1:5557 unless "endpoint" (vLLM's
    rule: a "*" host binds, others connect) or "bind" (ours: bound as given) says otherwise;
    "include_token_ids": false sends hashes only. Default: off."""
    swa_full_tokens_ratio: float = 0.8
    """Sliding-window models (Gemma 3, Mistral, Qwen2 with use_sliding_window): tokens of the
    sliding layers' K/V space as a fraction of the global layers' (SGLang's flag and default),
    in (0, 1]. The sliding space keeps only what some window still needs (see
    docs/architecture.md, "Sliding windows and the KV pool")."""
    disable_hybrid_swa_memory: bool = False
    """Keep every layer's K/V of every cached page, sliding layers included, in one pool (as
    for a model without sliding windows): more memory, no sliding page space (SGLang's flag)."""

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1; got {self.page_size}")
        for name in ("cuda_graph_max_bs", "torch_compile_max_bs"):  # one graph per 8 sizes
            if getattr(self, name) < 1:
                raise ValueError(f"{flag_of(name)} must be >= 1; got {getattr(self, name)}")
            if getattr(self, name) > MAX_CAPTURED_BS:
                raise ValueError(
                    f"{flag_of(name)} must be at most {MAX_CAPTURED_BS}; got {getattr(self, name)}"
                )
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"--max-total-tokens must be >= 1; got {self.max_total_tokens}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(
                f"--mem-fraction-static must be in (0, 1]; got {self.mem_fraction_static}"
            )
        gb = self.cpu_kv_cache_gb
        if gb is not None and not (0 < gb and math.isfinite(gb)):
            raise ValueError(f"--cpu-kv-cache-gb must be > 0 (GiB, finite); got {gb}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            allowed = ", ".join(ATTENTION_BACKENDS)
            raise ValueError(
                f"--attention-backend must be one of {allowed}; got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in ("auto", *DTYPE_NAMES):
            allowed = ", ".join(DTYPE_NAMES)
            raise ValueError(
                f"--kv-cache-dtype must be auto or one of {allowed}; got {self.kv_cache_dtype!r}"
            )
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(
                f"--swa-full-tokens-ratio must be in (0, 1]; got {self.swa_full_tokens_ratio}"
            )

    def kv_events(self) -> KVEventsConfig | None:
        """The parsed --kv-events-config, or None when events are off."""
        if self.kv_events_config is None:
            return None
        config = KVEventsConfig.from_json(self.kv_events_config)
        return config if config.enable_kv_cache_events else None

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's dtype for a model computing in `model_dtype`."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        return dtype_named(self.kv_cache_dtype, "--kv-cache-dtype")


HICACHE_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")  # SGLang's


@dataclass
class HiCacheConfig:
    """The second KV tier below the pool (SGLang's HiCache): host memory, or a memory-mapped
    file under --hicache-dir that also survives a restart."""

    enable_hierarchical_cache: bool = False
    """Keep KV pages evicted from the pool in a host tier and load them back on a hit,
    instead of recomputing them."""
    hicache_ratio: float = 2.0
    """Tier size as a multiple of the KV pool's pages (SGLang's default: 2.0); ignored when
    --hicache-size is given."""
    hicache_size: float = 0.0
    """Tier size in GB (10^9 bytes); 0: sized by --hicache-ratio."""
    hicache_write_policy: str = "write_through"
    """write_through (copy a page to the tier when it enters the radix tree) | write_back
    (copy when it is evicted from the pool) | write_through_selective (copy once its node
    was hit twice: only reused prefixes take tier room)."""
    hicache_dir: str | None = None
    """Folder for the tier's memory-mapped file and its index: a restarted server with the
    same model, page size and KV dtype serves the cached prefixes from it. Default: the tier
    lives in anonymous host memory and dies with the process."""

    def verify(self) -> None:
        """Rejects bad values, naming the flag; creates --hicache-dir if missing."""
        if not self.enable_hierarchical_cache:
            self._verify_unused()
            return
        policy = self.hicache_write_policy
        if policy not in HICACHE_WRITE_POLICIES:
            allowed = " | ".join(HICACHE_WRITE_POLICIES)
            raise ValueError(f"--hicache-write-policy must be one of {allowed}; got {policy!r}")
        if not (self.hicache_size >= 0 and math.isfinite(self.hicache_size)):
            raise ValueError(
                f"--hicache-size must be > 0 GB (0: use --hicache-ratio); got {self.hicache_size}"
            )
        if not (self.hicache_ratio > 0 and math.isfinite(self.hicache_ratio)):
            raise ValueError(f"--hicache-ratio must be > 0; got {self.hicache_ratio}")
        if self.hicache_dir is not None:
            _check_writable_dir(self.hicache_dir)

    def memory_tier_ratio(self) -> float:
        """The tier's size as a multiple of the pool's where it lives in memory and
        --hicache-ratio sizes it; 0.0 otherwise (no tier, a tier on disk, --hicache-size)."""
        in_memory = self.enable_hierarchical_cache and self.hicache_dir is None
        return self.hicache_ratio if in_memory and self.hicache_size == 0 else 0.0

    def _verify_unused(self) -> None:
        for f in fields(self):
            if f.name != "enable_hierarchical_cache" and getattr(self, f.name) != f.default:
                flag = flag_of(f.name)
                raise ValueError(f"{flag} needs --enable-hierarchical-cache")

    def num_tier_pages(self, pool_pages: int, page_nbytes: int) -> int:
        """Slots of the tier: --hicache-size GB of pages, else --hicache-ratio x the pool."""
        if self.hicache_size > 0:
            num = int(self.hicache_size * 1e9) // page_nbytes
            flag = f"--hicache-size {self.hicache_size}"
        else:
            num = int(self.hicache_ratio * pool_pages)
            flag = f"--hicache-ratio {self.hicache_ratio}"
        if num < 1:
            raise ValueError(f"{flag} holds no KV page of {page_nbytes} bytes; raise it")
        return num


def _check_writable_dir(path: str) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)  # new folders: owner-only
    except OSError as exc:
        raise ValueError(f"--hicache-dir {path!r} cannot be created: {exc}") from exc
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--hicache-dir {path!r} is not a writable folder")
