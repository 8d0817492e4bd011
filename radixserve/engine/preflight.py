"""What the engine checks before it loads a model: every flag's own range and choices, and
every combination it refuses, each error naming the flag (or Engine keyword).

`EngineCore.build` runs it first; `radixserve serve` and `generate` run it in their own
process before the engine core starts (so a bad flag is one line, not a traceback from the
core's process); tests/test_flag_fuzz.py calls `verify_engine_args` on its own, with no
model. What needs the model (its config, the memory left after its weights) is checked
while loading, also naming the flag.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch

from radixserve.config import (
    CacheConfig,
    DisaggregationConfig,
    HiCacheConfig,
    KVEventsConfig,
    LoadConfig,
    LoraConfig,
    ParallelConfig,
    SchedulerConfig,
    split_engine_kwargs,
)
from radixserve.config.server import check_resolves
from radixserve.disagg.auth import load_secret
from radixserve.engine.speculative import with_default_head
from radixserve.model.cpu_decode_stack import check_cpu_decode_stack
from radixserve.model.loader import check_load_format
from radixserve.model.quant.flag_checks import check_quantization_flags
from radixserve.model.source import ModelLoadError, resolve_model


class EngineConfigs(NamedTuple):
    """The configs an EngineCore is built from, checked (the scheduler's with defaults filled
    in: an EAGLE3 head for the default model), and the parsed --kv-events-config."""

    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    disaggregation: DisaggregationConfig
    hicache: HiCacheConfig
    lora: LoraConfig
    kv_events: KVEventsConfig | None


def verify_engine_args(model_path: str | None, kwargs: dict[str, Any]) -> EngineConfigs:
    """`Engine(model_path, **kwargs)`'s configs, checked: TypeError for an unknown keyword or
    a value of the wrong type, ValueError for a value or combination refused."""
    return verify_engine_configs(*split_engine_kwargs(model_path, kwargs))


def verify_engine_configs(
    load: LoadConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    parallel: ParallelConfig | None = None,
    disaggregation: DisaggregationConfig | None = None,
    hicache: HiCacheConfig | None = None,
    lora: LoraConfig | None = None,
) -> EngineConfigs:
    """Every check that needs no model, in the order EngineCore.build made them."""
    _verify_load(load)
    scheduler = with_default_head(load, scheduler)
    scheduler.verify()
    parallel = parallel or ParallelConfig()
    parallel.verify()
    hicache = hicache or HiCacheConfig()
    hicache.verify()
    if parallel.tp_size > 1 and hicache.enable_hierarchical_cache:
        raise ValueError(
            "--enable-hierarchical-cache keeps rank 0's KV only, so it does not work with "
            f"--tp-size {parallel.tp_size} yet; use --tp-size 1"
        )
    kv_events = cache.kv_events()  # a bad flag or no pyzmq: fail before loading
    if kv_events is not None and kv_events.publisher == "zmq":
        from radixserve.engine.kv_publisher import import_zmq

        import_zmq()
    disaggregation = disaggregation or DisaggregationConfig()
    disaggregation.verify(scheduler, parallel.tp_size)
    _verify_transfer(disaggregation)
    if parallel.tp_size > 1 and scheduler.speculative_model_algorithm:
        raise ValueError(
            f"--speculative-algorithm {scheduler.speculative_algorithm} drafts with a model, "
            f"which is not sharded over --tp-size {parallel.tp_size} yet; use NGRAM or "
            "--tp-size 1"
        )
    lora = lora or LoraConfig()
    _verify_lora(lora, scheduler, parallel, hicache)
    _verify_embedding(load, scheduler, disaggregation)
    _resolve("--model", load.model)  # last: a bad flag is named first, whatever the model
    if scheduler.speculative_algorithm == "STANDALONE":  # EAGLE heads: checked as they load
        _resolve("--speculative-draft-model-path", scheduler.speculative_draft_model_path)
    return EngineConfigs(load, cache, scheduler, parallel, disaggregation, hicache, lora, kv_events)


def _verify_load(load: LoadConfig) -> None:
    """--load-format, --dtype, --device (one this machine has), the quantization flags."""
    check_load_format(load)
    if load.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", load.device):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N; got {load.device!r}")
    device = load.torch_device()
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"--device {load.device}: this machine has {count} CUDA devices")
    load.torch_dtype()  # --dtype: one of DTYPE_NAMES or auto
    check_quantization_flags(load)
    check_cpu_decode_stack(load.cpu_decode_stack)
    if not -(2**63) <= load.seed < 2**64:  # torch.manual_seed's range
        raise ValueError(f"--seed must fit in 64 bits; got {load.seed}")


def _resolve(flag: str, model: str | None) -> None:
    """The model `flag` names exists (a folder, a .gguf file or a built-in config name):
    found at start, not after the target model has loaded (None, the default model: the
    loader says how to install it)."""
    if model is None:
        return
    if not str(model).strip():
        raise ValueError(f"{flag} must be a path or a built-in config name; got {model!r}")
    try:
        resolve_model(str(model))
    except ModelLoadError as exc:
        raise ModelLoadError(f"{flag}: {exc}") from None


def _verify_transfer(config: DisaggregationConfig) -> None:
    """A prefill or decode worker's secret file reads as a secret; a prefill worker's
    --disaggregation-bootstrap-host resolves (both were found once the model had loaded)."""
    if config.mode is None or config.disaggregation_transfer_backend == "fake":
        return
    if config.disaggregation_secret_file:
        load_secret(config.disaggregation_secret_file)
    if config.mode == "prefill":
        host, port = config.disaggregation_bootstrap_host, config.disaggregation_bootstrap_port
        check_resolves(host, port, "--disaggregation-bootstrap-host")


LORA_SPECULATION = ("NGRAM", "SUFFIX")
"""Speculation LoRA serving takes: drafts from the prompt or earlier outputs (SUFFIX's are
kept per cache namespace, which holds the adapter), verified by the adapter's own forward."""


def _verify_lora(
    lora: LoraConfig, scheduler: SchedulerConfig, parallel: ParallelConfig, hicache: HiCacheConfig
) -> None:
    """The LoRA flags, and what LoRA serving does not cover yet."""
    lora.verify()
    if not lora.enabled:
        return
    if parallel.tp_size > 1:
        raise ValueError(f"--enable-lora is not sharded over --tp-size {parallel.tp_size} yet")
    algorithm = scheduler.speculative_algorithm
    if algorithm not in (None, *LORA_SPECULATION):  # their drafts are looked up, not computed
        raise ValueError(
            f"--enable-lora works with --speculative-algorithm {' or '.join(LORA_SPECULATION)} "
            f"only, not {algorithm} yet (its draft model would run without the adapter)"
        )
    if hicache.enable_hierarchical_cache and hicache.hicache_dir is not None:
        raise ValueError(  # in memory, the adapter's load id in the namespace keys its pages
            "--enable-lora does not work with --hicache-dir yet (a tier on disk does not "
            "record which adapter weights its KV came from)"
        )


def _verify_embedding(
    load: LoadConfig, scheduler: SchedulerConfig, disaggregation: DisaggregationConfig
) -> None:
    """An embedding server generates nothing: flags about generating are a mistake."""
    if not load.is_embedding:
        return
    if scheduler.speculative_algorithm:
        raise ValueError(
            "--speculative-algorithm drafts output tokens; --is-embedding generates none"
        )
    if disaggregation.mode is not None:
        raise ValueError(
            "--disaggregation-mode splits prefill from decode; --is-embedding has no decode"
        )
