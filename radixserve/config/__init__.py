"""Configuration dataclasses, one module per concern. Each field's docstring is its `--help`
text (see cli_args.py); callers import every public name from here.

    model           ModelConfig (an HF config.json, normalized)
    load            LoadConfig (model path, device, dtype, quantization)
    cache           CacheConfig (KV pool, attention backend), HiCacheConfig (the tier below)
    kv_events       KVEventsConfig (--kv-events-config for KV-aware routers)
    scheduler       SchedulerConfig (ordering, admission, batching, speculative decoding)
    parallel        ParallelConfig (tensor parallelism)
    disaggregation  DisaggregationConfig (prefill/decode workers)
    lora            LoraConfig (multi-LoRA adapters)
    server          ServerConfig (HTTP)
    keys            resolve_keys (API keys from flag, file or environment), redact_secrets
    fleet           FleetConfig (`radixserve fleet`)
    train           TrainEagleConfig (`radixserve train-eagle`)
    engine_args     split_engine_kwargs (flat engine keywords -> the dataclasses above)
"""

from __future__ import annotations

from radixserve.config.cache import HICACHE_WRITE_POLICIES, CacheConfig, HiCacheConfig
from radixserve.config.disaggregation import (
    DISAGGREGATION_MODES,
    SGLANG_BOOTSTRAP_PORT,
    TRANSFER_BACKENDS,
    DisaggregationConfig,
)
from radixserve.config.engine_args import split_engine_kwargs
from radixserve.config.fleet import ROUTER_POLICIES, FleetConfig
from radixserve.config.keys import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    is_secret_field,
    redact_secrets,
    resolve_keys,
)
from radixserve.config.kv_events import KV_EVENT_PUBLISHERS, KVEventsConfig, offset_endpoint
from radixserve.config.load import DTYPE_NAMES, LoadConfig
from radixserve.config.lora import LoraConfig, parse_lora_path
from radixserve.config.model import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    UnsupportedModelError,
)
from radixserve.config.parallel import DIST_BACKENDS, ParallelConfig
from radixserve.config.scheduler import (
    DRAFT_MODEL_ALGORITHMS,
    PIN_POLICIES,
    SPECULATIVE_ALGORITHMS,
    SchedulerConfig,
)
from radixserve.config.server import ServerConfig
from radixserve.config.train import TrainEagleConfig

__all__ = [
    "ADMIN_API_KEY_ENV",
    "API_KEY_ENV",
    "DISAGGREGATION_MODES",
    "DIST_BACKENDS",
    "DTYPE_NAMES",
    "DRAFT_MODEL_ALGORITHMS",
    "HICACHE_WRITE_POLICIES",
    "KV_EVENT_PUBLISHERS",
    "PIN_POLICIES",
    "ROUTER_POLICIES",
    "SGLANG_BOOTSTRAP_PORT",
    "SPECULATIVE_ALGORITHMS",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "TRANSFER_BACKENDS",
    "CacheConfig",
    "DisaggregationConfig",
    "FleetConfig",
    "HiCacheConfig",
    "KVEventsConfig",
    "LoadConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "TrainEagleConfig",
    "UnsupportedModelError",
    "is_secret_field",
    "offset_endpoint",
    "parse_lora_path",
    "redact_secrets",
    "resolve_keys",
    "split_engine_kwargs",
]
