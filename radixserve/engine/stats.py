"""Engine-wide counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    cached_tokens_host: int = 0  # of those, loaded back from the hierarchical cache's tier
    prefill_tokens_computed: int = 0  # tokens computed by prefill chunks (recomputes included)
    decode_tokens: int = 0
    evicted_pages: int = 0
    retractions: int = 0
    forward_steps: int = 0
    spec_verify_steps: int = 0  # decode steps of speculating requests (each verifies a draft)
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # draft tokens accepted
    kv_pages_sent: int = 0  # disaggregated prefill: prompt KV pages published
    kv_bytes_sent: int = 0
    kv_pages_received: int = 0  # disaggregated decode: KV pages stored into the pool
    kv_bytes_received: int = 0
    kv_transfer_failures: int = 0  # decode: requests ended because their KV did not arrive
    jump_forward_tokens: int = 0  # output tokens a grammar forced, appended unsampled
    max_req_sliding_pages: int = 0  # most sliding-window pages one running request held
    # between steps (a sliding-window model's second page space: cache/swa_pool.py)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def spec_accept_length(self) -> float:
        """Tokens per verify step: the accepted drafts plus the one token each step samples."""
        steps = self.spec_verify_steps
        return (self.spec_accepted_tokens + steps) / steps if steps else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {
            "cache_hit_rate": self.cache_hit_rate,
            "spec_accept_length": self.spec_accept_length,
        }
