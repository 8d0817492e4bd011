"""split_engine_kwargs: flat engine keywords (`page_size=16`, ...) to the config dataclasses."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from radixserve.config.cache import CacheConfig, HiCacheConfig
from radixserve.config.disaggregation import DisaggregationConfig
from radixserve.config.field_types import check_field_types
from radixserve.config.load import LoadConfig
from radixserve.config.lora import LoraConfig
from radixserve.config.parallel import ParallelConfig
from radixserve.config.scheduler import SchedulerConfig


def split_engine_kwargs(
    model_path: str | None, kwargs: dict[str, Any]
) -> tuple[
    LoadConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    DisaggregationConfig,
    HiCacheConfig,
    LoraConfig,
]:
    """Distributes flat engine arguments (`page_size=16`, ...) over the config dataclasses;
    an unknown keyword or a value its field cannot hold (field_types.py) is a TypeError
    naming it."""
    groups = (
        LoadConfig,
        CacheConfig,
        SchedulerConfig,
        ParallelConfig,
        DisaggregationConfig,
        HiCacheConfig,
        LoraConfig,
    )
    values: dict[type, dict[str, Any]] = {cls: {} for cls in groups}
    if model_path is not None:
        values[LoadConfig]["model"] = model_path
    for key, value in kwargs.items():
        owner = next((cls for cls in groups if key in {f.name for f in fields(cls)}), None)
        if owner is None:
            raise TypeError(f"unknown engine argument {key!r}")
        values[owner][key] = value
    for cls in groups:
        check_field_types(cls, values[cls])
    return tuple(cls(**values[cls]) for cls in groups)
