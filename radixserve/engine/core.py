"""EngineCore: the model runner, prefix cache and scheduler built from configs, with no I/O.

The in-process `Engine` and the server's core process both drive one of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.cache.hiradix_cache import create_hierarchical_cache
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.prefix_cache import PrefixCache
from radixserve.cache.radix_cache import create_prefix_cache
from radixserve.config import (
    CacheConfig,
    DisaggregationConfig,
    HiCacheConfig,
    KVEventsConfig,
    LoadConfig,
    LoraConfig,
    ParallelConfig,
    SchedulerConfig,
)
from radixserve.config.lora import check_lora_name
from radixserve.engine.preflight import verify_engine_configs
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.speculative import create_drafter
from radixserve.model.fingerprint import model_fingerprint
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.lora import LoraWeights, load_lora_weights
from radixserve.model.lora_adapter import LoraAdapter
from radixserve.model.lora_choice import lora_kernel
from radixserve.model.runner import ModelRunner
from radixserve.model.tokenizer import load_tokenizer
from radixserve.model.tp_runner import TPModelRunner

if TYPE_CHECKING:  # msgspec / pyzmq are needed only with --kv-events-config
    from radixserve.cache.kv_events import KVEventSink
    from radixserve.engine.kv_publisher import KVEventPublisher


@dataclass
class EngineCore:
    loaded: LoadedModel
    runner: ModelRunner | TPModelRunner
    scheduler: Scheduler
    tokenizer: Any
    context_length: int
    kv_publisher: KVEventPublisher | None = None  # --kv-events-config (rank 0 only)
    lora_config: LoraConfig = field(default_factory=LoraConfig)

    @classmethod
    def build(
        cls,
        load_config: LoadConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        parallel_config: ParallelConfig | None = None,
        disaggregation_config: DisaggregationConfig | None = None,
        hicache_config: HiCacheConfig | None = None,
        lora_config: LoraConfig | None = None,
    ) -> EngineCore:
        checked = verify_engine_configs(
            load_config,
            cache_config,
            scheduler_config,
            parallel_config,
            disaggregation_config,
            hicache_config,
            lora_config,
        )
        scheduler_config, parallel_config = checked.scheduler, checked.parallel
        lora_config = checked.lora
        loaded, runner = _build_runner(
            load_config,
            cache_config,
            scheduler_config,
            parallel_config,
            checked.hicache.memory_tier_ratio(),
        )
        publisher = None
        try:
            _attach_lora(loaded, runner, lora_config, load_config.enable_deterministic_inference)
            publisher = _start_publisher(checked.kv_events)
            configs = (load_config, cache_config, scheduler_config, checked.disaggregation)
            core = cls._assemble(loaded, runner, *configs, checked.hicache, publisher)
            core.lora_config = lora_config
            return core
        except BaseException:
            if publisher is not None:
                publisher.close()
            if isinstance(runner, TPModelRunner):
                runner.close()
            raise

    @classmethod
    def _assemble(
        cls,
        loaded: LoadedModel,
        runner: ModelRunner | TPModelRunner,
        load_config: LoadConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        disaggregation_config: DisaggregationConfig,
        hicache_config: HiCacheConfig,
        publisher: KVEventPublisher | None = None,
    ) -> EngineCore:
        """The tokenizer, prefix cache and scheduler around a built runner."""
        tokenizer = load_tokenizer(loaded)
        pool = runner.pool
        events = None
        if publisher is not None:
            from radixserve.cache.kv_events import KVEventSink, device_medium

            medium = device_medium(pool.device.type)
            with_ids = publisher.config.include_token_ids
            events = KVEventSink(pool.page_size, medium, publisher.publish, with_ids)
        _check_sliding_space(pool, hicache_config, disaggregation_config)
        cache = _create_cache(loaded, pool, scheduler_config, hicache_config, events)
        eos_ids = set(loaded.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        drafter = create_drafter(scheduler_config, runner, load_config, cache_config, tokenizer)
        scheduler = Scheduler(
            runner,
            cache,
            scheduler_config,
            tuple(sorted(eos_ids)),
            tokenizer,
            drafter=drafter,
            disaggregation=disaggregation_config,
        )
        context_length = _context_length(scheduler_config, loaded)
        return cls(loaded, runner, scheduler, tokenizer, context_length, publisher)

    def close(self) -> None:
        """Saves a persistent cache tier, stops the KV event publisher, disaggregation's
        transfer and the tensor-parallel ranks, if any."""
        self.cache.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        self.scheduler.close()
        if isinstance(self.runner, TPModelRunner):
            self.runner.close()

    @property
    def cache(self):
        return self.scheduler.cache

    def flush_cache(self) -> bool:
        """Empties the prefix cache, pins included; refused (False) while requests are queued
        or running."""
        if self.scheduler.has_work():
            return False
        self.scheduler.pins.clear()
        self.cache.reset()
        return True

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, dict]:
        """Loads a PEFT folder as adapter `lora_name` while serving (SGLang's route); returns
        every adapter's load id and folder. Refused past --max-loaded-loras adapters (as
        SGLang: nothing held is evicted to make room; unload one first)."""
        lora = self._lora_weights()
        limit = self.lora_config.loaded_limit
        if len(lora.ids) >= limit:
            raise ValueError(
                f"lora_name {lora_name!r}: {limit} adapters are loaded (--max-loaded-loras); "
                "unload one first"
            )
        if lora_name in lora.ids:
            raise ValueError(f"lora_name {lora_name!r} is already loaded")
        check_lora_name(lora_name)
        max_rank = self.lora_config.max_lora_rank
        lora.add(LoraAdapter.load(lora_name, lora_path, self.loaded.config, max_rank))
        return {"ids": dict(lora.ids), "paths": dict(lora.paths)}

    def unload_lora_adapter(self, lora_name: str) -> dict[str, dict]:
        """Unloads adapter `lora_name`; refused while a request of it is in the engine.
        Its KV stays in the tree under its load id, unreachable, until evicted."""
        lora = self._lora_weights()
        if lora_name not in lora.ids:
            raise ValueError(f"lora_name {lora_name!r} is not loaded")
        load_id = lora.ids[lora_name]
        if any(req.lora_id == load_id for req in self.scheduler.all_reqs()):
            raise ValueError(f"lora_name {lora_name!r} has requests running or queued")
        lora.remove(lora_name)
        return {"ids": dict(lora.ids), "paths": dict(lora.paths)}

    def _lora_weights(self) -> LoraWeights:
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        return self.runner.lora

    def list_pins(self) -> list[dict]:
        """Every retention pin (sessions and pinned prefixes), oldest first."""
        return self.scheduler.pins.describe()

    def unpin(self, key: str, namespace: str | None = None) -> bool:
        """Ends the pin named `key` (session:<id> | prefix:<name>) in `namespace` (a
        cache_salt); False if there is none."""
        return self.scheduler.pins.unpin(key, namespace)

    def tree_summary(self, top_k: int = 10, namespaces: list | None = None) -> dict:
        """The tree's size and shape; its largest subtrees from `namespaces` only (None: all)."""
        return self.cache.tree_summary(top_k, namespaces).to_dict()

    def check_integrity(self) -> None:
        """Raises unless every page is free, owned by the tree, or held by a running request."""
        self.cache.check_integrity(self.scheduler.held_pages())

    def tree_outline(self) -> dict[str, Any]:
        """The radix tree as the dashboard draws it (cache/tree_summary.py)."""
        return self.cache.tree_outline()

    def get_stats(self) -> dict[str, Any]:
        pool = self.runner.pool
        tree = self.cache.size_info()
        scheduler = self.scheduler
        used = pool.allocator.capacity - pool.allocator.num_free
        grammar = scheduler.grammar_stats()
        return {
            "num_running_reqs": len(scheduler.running),
            "num_waiting_reqs": len(scheduler.waiting) + len(scheduler.inbox),
            "num_waiting_tokens": sum(
                len(r.input_ids) for r in (*scheduler.waiting, *scheduler.inbox)
            ),
            "page_size": pool.page_size,
            "pool_capacity_pages": pool.allocator.capacity,
            "pool_free_pages": pool.allocator.num_free,
            "kv_usage": (used - tree.evictable_pages) / pool.allocator.capacity,
            "tree_pages": tree.total_pages,
            "tree_evictable_pages": tree.evictable_pages,
            "tree_protected_pages": tree.protected_pages,
            "tree_pinned_pages": tree.pinned_pages,
            "num_pins": len(scheduler.pins),
            "max_pins": scheduler.pins.max_pins,
            "max_pinned_pages": scheduler.pins.max_pinned_pages,
            "pins_degraded": scheduler.pins.num_degraded,
            "pins_refused": scheduler.pins.num_refused,
            "new_token_ratio": scheduler.new_token_ratio,
            "num_compiling_reqs": len(scheduler.compiling),
            "grammar_compiles": grammar.compiles if grammar else 0,
            "grammar_cache_hits": grammar.cache_hits if grammar else 0,
            "grammar_cache_entries": grammar.cache_entries if grammar else 0,
            **self.cache.tier_stats(),
            **scheduler.stats.as_dict(),
            **(self.kv_publisher.stats() if self.kv_publisher else {}),
        }


def _attach_lora(
    loaded: LoadedModel, runner: ModelRunner, lora: LoraConfig, deterministic: bool
) -> None:
    """Loads --lora-paths into the runner and the model (nothing without --enable-lora), their
    deltas on the kernel --cpu-lora-kernel picks (model/lora_choice.py)."""
    if not lora.enabled:
        return
    if loaded.config.moe is not None:
        raise ValueError(
            "--enable-lora does not cover mixture-of-experts models "
            f"({loaded.config.architecture}) yet: their experts would ignore the adapters"
        )
    weights = load_lora_weights(
        loaded.config,
        lora.adapter_paths(),
        lora.max_lora_rank,
        loaded.dtype,
        runner.device,
        lora.max_loras_per_batch,
        lora.lora_eviction_policy,
        lora_kernel(loaded.config, lora.cpu_lora_kernel, runner.device, deterministic),
    )
    runner.lora = weights
    loaded.model.use_lora(weights)


def _check_sliding_space(
    pool: KVPool, hicache: HiCacheConfig, disaggregation: DisaggregationConfig
) -> None:
    """Refuses what copies whole pages when a sliding-window model's K/V lives in two page
    spaces (cache/swa_pool.py)."""
    if pool.sliding_window is None:
        return
    if hicache.enable_hierarchical_cache:
        raise ValueError(
            "--enable-hierarchical-cache does not cover a sliding-window model's second page "
            "space yet; add --disable-hybrid-swa-memory (every layer's K/V in one pool)"
        )
    if disaggregation.disaggregation_mode != "null":
        raise ValueError(
            f"--disaggregation-mode {disaggregation.disaggregation_mode} does not send a "
            "sliding-window model's second page space yet; add --disable-hybrid-swa-memory"
        )


def _create_cache(
    loaded: LoadedModel,
    pool: KVPool,
    scheduler_config: SchedulerConfig,
    hicache_config: HiCacheConfig,
    events: KVEventSink | None,
) -> PrefixCache:
    """The radix cache (over two tiers with --enable-hierarchical-cache), or none."""
    if not hicache_config.enable_hierarchical_cache:
        disable = scheduler_config.disable_radix_cache
        window = pool.sliding_window
        return create_prefix_cache(disable, pool.allocator, pool.page_size, events, window)
    if scheduler_config.disable_radix_cache:
        raise ValueError(
            "--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache"
        )
    fingerprint = model_fingerprint(loaded)
    return create_hierarchical_cache(pool, hicache_config, fingerprint, events)


def _start_publisher(config: KVEventsConfig | None) -> KVEventPublisher | None:
    """The ZMQ publisher --kv-events-config asks for; None when off or publisher "null"."""
    if config is None or config.publisher == "null":
        return None
    from radixserve.engine.kv_publisher import KVEventPublisher

    return KVEventPublisher(config)


def _context_length(scheduler_config: SchedulerConfig, loaded: LoadedModel) -> int:
    return scheduler_config.context_length or loaded.config.max_position_embeddings


def _build_runner(
    load_config: LoadConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    parallel_config: ParallelConfig,
    tier_ratio: float,
) -> tuple[LoadedModel, ModelRunner | TPModelRunner]:
    """One process's runner, or rank 0's TPModelRunner driving the other ranks; `tier_ratio`:
    an in-memory host tier's share of the default KV memory (HiCacheConfig.memory_tier_ratio)."""
    if parallel_config.tp_size > 1:
        runner = TPModelRunner.create(
            load_config, cache_config, parallel_config, scheduler_config.context_length, tier_ratio
        )
        return runner.loaded, runner
    loaded = load_model(load_config)
    # the RoPE table is built before any CUDA graph captures it (positions are never read on
    # the host to grow it later)
    loaded.model.rotary.reserve(
        _context_length(scheduler_config, loaded), load_config.torch_device()
    )
    return loaded, ModelRunner.from_loaded(loaded, load_config, cache_config, tier_ratio)
