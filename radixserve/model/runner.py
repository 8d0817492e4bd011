"""ModelRunner: owns the model, the KV pool and the attention backend; ForwardBatch -> logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixserve.attention import AttentionBackend, create_attention_backend
from radixserve.cache.kv_pool import KVPool
from radixserve.config import CacheConfig, LoadConfig, ModelConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import LoadedModel, load_model

GiB = 1 << 30


class LogitsOutput(NamedTuple):
    last: torch.Tensor  # [num_reqs, vocab] fp32: logits at each request's last new token
    all: torch.Tensor | None  # [num_tokens, vocab] fp32 when the batch asked for all positions


@dataclass
class ModelRunner:
    model: LlamaForCausalLM
    config: ModelConfig
    pool: KVPool
    attn: AttentionBackend

    @classmethod
    def create(
        cls, load_config: LoadConfig | None = None, cache_config: CacheConfig | None = None
    ) -> ModelRunner:
        """Loads the model, then sizes the KV pool from what memory is left."""
        return cls.from_loaded(load_model(load_config or LoadConfig()), load_config, cache_config)

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        load_config: LoadConfig | None = None,
        cache_config: CacheConfig | None = None,
    ) -> ModelRunner:
        load_config = load_config or LoadConfig()
        cache_config = cache_config or CacheConfig()
        device, dtype = load_config.torch_device(), load_config.torch_dtype()
        budget = kv_budget_bytes(cache_config, device)
        pool = KVPool.for_model(loaded.config, cache_config, dtype, device, budget_bytes=budget)
        attn = create_attention_backend(
            cache_config.attention_backend,
            pool,
            device,
            sliding_window=loaded.config.sliding_window,
        )
        return cls(model=loaded.model, config=loaded.config, pool=pool, attn=attn)

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Runs one forward over a mixed extend/decode batch, writing its K/V into the pool."""
        self.attn.init_forward(batch)
        hidden = self.model(batch, self.attn)
        last = self.model.compute_logits(hidden[batch.last_token_indices()])
        all_logits = self.model.compute_logits(hidden) if batch.return_all_logits else None
        return LogitsOutput(last=last, all=all_logits)


def kv_budget_bytes(cache_config: CacheConfig, device: torch.device) -> int | None:
    """Memory for the KV pool: what mem_fraction_static leaves after weights on CUDA,
    cpu_kv_cache_gb on CPU; None when max_total_tokens sizes the pool instead."""
    if cache_config.max_total_tokens is not None:
        return None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cache_config.mem_fraction_static) - used
        if budget <= 0:
            raise ValueError(
                f"mem_fraction_static={cache_config.mem_fraction_static} leaves no memory for the "
                f"KV pool ({used / GiB:.1f} GiB of {total / GiB:.1f} GiB already in use)"
            )
        return budget
    return int(cache_config.cpu_kv_cache_gb * GiB)
