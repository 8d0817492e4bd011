"""EngineCore: the model runner, prefix cache and scheduler built from configs, with no I/O.

The in-process `Engine` and the server's core process both drive one of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.cache.radix_cache import create_prefix_cache
from radixserve.config import CacheConfig, LoadConfig, SchedulerConfig
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.speculative import create_drafter
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.runner import ModelRunner
from radixserve.model.tokenizer import load_tokenizer


@dataclass
class EngineCore:
    loaded: LoadedModel
    runner: ModelRunner
    scheduler: Scheduler
    tokenizer: Any
    context_length: int

    @classmethod
    def build(
        cls, load_config: LoadConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig
    ) -> EngineCore:
        scheduler_config.verify()
        loaded = load_model(load_config)
        context_length = scheduler_config.context_length or loaded.config.max_position_embeddings
        # the RoPE table is built before any CUDA graph captures it (positions are never
        # read on the host to grow it later)
        loaded.model.rotary.reserve(context_length, load_config.torch_device())
        runner = ModelRunner.from_loaded(loaded, load_config, cache_config)
        tokenizer = load_tokenizer(loaded)
        pool = runner.pool
        cache = create_prefix_cache(
            scheduler_config.disable_radix_cache, pool.allocator, pool.page_size
        )
        eos_ids = set(loaded.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        drafter = create_drafter(scheduler_config, runner, load_config, cache_config, tokenizer)
        scheduler = Scheduler(
            runner, cache, scheduler_config, tuple(sorted(eos_ids)), tokenizer, drafter=drafter
        )
        return cls(loaded, runner, scheduler, tokenizer, context_length)

    @property
    def cache(self):
        return self.scheduler.cache

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are queued or running."""
        if self.scheduler.has_work():
            return False
        self.cache.reset()
        return True

    def check_integrity(self) -> None:
        """Raises unless every page is free, owned by the tree, or held by a running request."""
        self.cache.check_integrity(self.scheduler.held_pages())

    def get_stats(self) -> dict[str, Any]:
        pool = self.runner.pool
        tree = self.cache.size_info()
        scheduler = self.scheduler
        used = pool.allocator.capacity - pool.allocator.num_free
        grammar = scheduler.grammar_stats()
        return {
            "num_running_reqs": len(scheduler.running),
            "num_waiting_reqs": len(scheduler.waiting) + len(scheduler.inbox),
            "page_size": pool.page_size,
            "pool_capacity_pages": pool.allocator.capacity,
            "pool_free_pages": pool.allocator.num_free,
            "kv_usage": (used - tree.evictable_pages) / pool.allocator.capacity,
            "tree_pages": tree.total_pages,
            "tree_evictable_pages": tree.evictable_pages,
            "tree_protected_pages": tree.protected_pages,
            "new_token_ratio": scheduler.new_token_ratio,
            "num_compiling_reqs": len(scheduler.compiling),
            "grammar_compiles": grammar.compiles if grammar else 0,
            "grammar_cache_hits": grammar.cache_hits if grammar else 0,
            **scheduler.stats.as_dict(),
        }
