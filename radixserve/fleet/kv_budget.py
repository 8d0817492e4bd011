"""The KV pool each CPU worker of a fleet takes when nobody chose one: the default share
of the memory available, less every worker's copy of the weights, split between them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from radixserve.config import split_engine_kwargs
from radixserve.config.cache import CPU_KV_MEMORY_FRACTION
from radixserve.model.source import ModelLoadError, default_model_path
from radixserve.native.machine import GiB, available_memory_bytes

logger = logging.getLogger(__name__)


def split_cpu_kv_memory(num_workers: int, engine_args: dict[str, Any]) -> dict[str, Any]:
    """CPU workers whose pool size nobody chose share the default (CPU_KV_MEMORY_FRACTION of
    the memory available) between them: `--cpu-kv-cache-gb` per worker, logged; else as
    given. Each worker alone would take the fraction of what it saw at its start. A worker's
    in-memory host tier takes its share of that memory too (runner.kv_budget_bytes)."""
    if engine_args.get("max_total_tokens") or engine_args.get("cpu_kv_cache_gb"):
        return engine_args
    configs = split_engine_kwargs(None, engine_args)
    if configs[0].torch_device().type != "cpu":
        return engine_args
    tier_ratio = configs[5].memory_tier_ratio()
    available = available_memory_bytes()
    if available is None:
        return engine_args
    weights = num_workers * model_file_bytes(engine_args["model"])
    kv_bytes = max(available - weights, 0) * CPU_KV_MEMORY_FRACTION
    share = kv_bytes / num_workers / (1 + tier_ratio) / GiB
    logger.info(
        "KV pool per worker: %.2f GiB (%.0f%% of %.1f GiB available, less %d copies of the "
        "weights, / %d workers%s; --cpu-kv-cache-gb to choose)",
        share, 100 * CPU_KV_MEMORY_FRACTION, available / GiB, num_workers, num_workers,
        f", shared 1 : {tier_ratio:g} with the host tier" if tier_ratio else "",
    )  # fmt: skip
    return engine_args | {"cpu_kv_cache_gb": max(round(share, 2), 0.01)}


def model_file_bytes(model: str | None) -> int:
    """Bytes of a model's weight files (a GGUF file, or a folder's safetensors / bin /
    gguf; None: the default model's GGUF); 0 for a name that is not on disk (a built-in
    config) or a default model that is not installed (each worker then says so)."""
    try:
        path = default_model_path() if model is None else Path(model)
    except ModelLoadError:
        return 0
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    files = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")]
    return sum(p.stat().st_size for p in files)
