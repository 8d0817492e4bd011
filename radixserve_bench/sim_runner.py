"""SimRunner: what the Scheduler needs from a ModelRunner, with a cost model instead of a model.

The KV pool is real (its page allocator is what the scheduler and the radix cache manage) but
its tensors are one float per token, so a pool of a million tokens costs a few MB. `forward`
computes nothing: it charges the batch's virtual seconds to a clock and returns one-hot
logits over a tiny vocabulary, so that greedy sampling is cheap and deterministic:

    next token = f(last token, position)      identical sequences get identical answers,
                                              as under a real model's greedy decoding
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.config import CacheConfig, ModelConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.runner import LogitsOutput

SIM_VOCAB_SIZE = 64  # tokens the simulated model answers with


@dataclass
class CostModel:
    """Virtual seconds of one forward step. Defaults: roughly SmolLM2-135M, fp32, 2 CPU cores,
    torch_native attention (prefill ~550 tok/s; decode ~360 tok/s at batch 64 on short
    contexts, ~20 tok/s at batch 1). Quadratic prefill attention is folded into prefill_cost."""

    step_overhead: float = 0.05
    """Fixed seconds of every step (on CPU: reading all the weights once)."""
    prefill_cost: float = 0.0018
    """Seconds per token of a prefill chunk (a request computing more than one token)."""
    decode_cost: float = 0.0019
    """Seconds per decoding request (one new token)."""
    kv_cost: float = 4e-6
    """Seconds per KV token a request's attention reads in a step (its prefix + new tokens):
    torch_native copies each page out of the pool, then SDPA reads it, in every layer
    (profiled: ~4e-6 s per token over 30 layers at batch 16, 1.1k-token contexts)."""

    tier_copy_cost: float = 1e-5
    """Seconds per token copied between the pool and the hierarchical cache's host tier
    (either way): a memcpy of its KV, ~46 KB per token for SmolLM2 in fp32, at ~5 GB/s."""

    def step_seconds(self, extend_lens: list[int], prefix_lens: list[int]) -> float:
        """The virtual duration of a step that computes `extend_lens` new tokens on top of
        `prefix_lens` cached ones, request by request."""
        prefill = sum(e for e in extend_lens if e > 1)
        decode = sum(1 for e in extend_lens if e == 1)
        attended = sum(extend_lens) + sum(prefix_lens)
        return (
            self.step_overhead
            + prefill * self.prefill_cost
            + decode * self.decode_cost
            + attended * self.kv_cost
        )


def sim_model_config(vocab_size: int = SIM_VOCAB_SIZE) -> ModelConfig:
    """A model of one layer, one KV head of one dimension: pool tensors of one float per token."""
    return ModelConfig(
        architecture="Simulated",
        vocab_size=vocab_size,
        hidden_size=1,
        intermediate_size=1,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=1 << 30,
    )


class SimRunner:
    """Stands in for ModelRunner: a real paged pool, a cost model, a virtual clock."""

    def __init__(
        self, cache_config: CacheConfig, cost: CostModel, vocab_size: int = SIM_VOCAB_SIZE
    ):
        if cache_config.max_total_tokens is None:
            raise ValueError("the simulator needs max_total_tokens to size its KV pool")
        self.config = sim_model_config(vocab_size)
        self.pool = KVPool.for_model(self.config, cache_config, torch.float32, "cpu")
        self.cost = cost
        self.clock = 0.0  # virtual seconds of all forwards so far
        self.last_seconds = 0.0  # virtual seconds of the latest forward
        self.last_num_reqs = 0  # requests in the latest forward
        self.wall_seconds = 0.0  # real seconds spent inside forward, to subtract from a step

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Charges the batch's cost to the clock; one-hot logits at each request's last token."""
        start = time.perf_counter()
        if batch.return_all_logits:
            raise ValueError("the simulator computes no input logprobs")
        self.last_seconds = self.cost.step_seconds(batch.extend_lens, batch.prefix_lens)
        self.clock += self.last_seconds
        self.last_num_reqs = batch.num_reqs
        logits = self._one_hot(batch, batch.last_token_indices())  # [num_reqs, vocab]
        verify = None  # speculative decoding's verify rows, answered by the same model
        if batch.verify_indices is not None:
            verify = self._one_hot(batch, batch.verify_indices)
        self.wall_seconds += time.perf_counter() - start
        return LogitsOutput(last=logits, all=None, verify=verify)

    def _one_hot(self, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """Logits picking `next_token` at the batch's token indices `rows`. [len(rows), vocab]"""
        next_ids = next_token(batch.input_ids[rows], batch.positions[rows], self.config.vocab_size)
        logits = torch.zeros(len(rows), self.config.vocab_size)
        logits[torch.arange(len(rows)), next_ids] = 1.0
        return logits


def next_token(last_ids: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The simulated model's greedy answer to a sequence ending in `last_ids` at `positions`."""
    return (last_ids * 7919 + positions * 104729 + 12345) % vocab_size
