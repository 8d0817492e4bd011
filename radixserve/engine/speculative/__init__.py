"""Speculative decoding: a `Drafter` proposes tokens, the running batch verifies them in
one forward (K + 1 extend tokens per speculating request), the `Verifier` keeps a prefix.

    scheduler decode phase      drafter.propose(req) -> K tokens   (ngram.py: NGRAM,
                                                                    suffix.py: SUFFIX,
                                                                    auto.py: AUTO)
    batch_builder               [last token, d1 .. dK] over the request's cached prefix
    model forward               logits at the K + 1 rows (LogitsOutput.verify)
                                (EAGLE / EAGLE3: + hidden states -> drafter.on_forward)
    verifier                    accepted drafts + the target's token (lossless rule)
    req_pages.trim              frees the rejected tail's emptied pages
"""

from __future__ import annotations

from radixserve.config import CacheConfig, LoadConfig, SchedulerConfig
from radixserve.engine.speculative.auto import AutoDrafter
from radixserve.engine.speculative.drafter import Draft, Drafter
from radixserve.engine.speculative.eagle import (
    EagleDrafter,
    create_eagle_drafter,
    with_default_head,
)
from radixserve.engine.speculative.model_drafter import (
    ModelDrafter,
    load_draft_runner,
    self_draft_runner,
)
from radixserve.engine.speculative.ngram import NgramDrafter
from radixserve.engine.speculative.speculator import Speculator
from radixserve.engine.speculative.suffix import SuffixDrafter
from radixserve.engine.speculative.verifier import Verified, Verifier
from radixserve.model.runner import ModelRunner

__all__ = [
    "AutoDrafter",
    "Draft",
    "Drafter",
    "EagleDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "Speculator",
    "SuffixDrafter",
    "Verified",
    "Verifier",
    "create_drafter",
    "with_default_head",
]


def create_drafter(
    config: SchedulerConfig,
    target: ModelRunner | None = None,
    load_config: LoadConfig | None = None,
    cache_config: CacheConfig | None = None,
    tokenizer=None,
) -> Drafter | None:
    """The drafter `config.speculative_algorithm` names; None when speculation is off.
    SELF, STANDALONE, EAGLE and EAGLE3 draft with a model: they need the `target` runner (and
    STANDALONE the load and cache configs to load its draft model like the target)."""
    if config.speculative_algorithm is None:
        return None
    config.verify()  # names the flag of an unknown algorithm or a bad combination
    algorithm = config.speculative_algorithm
    if algorithm in ("NGRAM", "SUFFIX"):
        return _lookup_drafter(config, algorithm)
    if algorithm == "AUTO":
        lookups = [_lookup_drafter(config, "SUFFIX"), _lookup_drafter(config, "NGRAM")]
        model = None
        if config.speculative_model_algorithm == "EAGLE3":
            model = create_eagle_drafter(config, _needs(target, "AUTO's EAGLE3"))
        return AutoDrafter(lookups, model)
    target = _needs(target, algorithm)
    if algorithm in ("EAGLE3", "EAGLE"):
        return create_eagle_drafter(config, target, algorithm)
    cache_config = cache_config or CacheConfig()
    if algorithm == "SELF":
        layers = config.speculative_self_layers
        runner = self_draft_runner(target, layers, cache_config.attention_backend)
    else:
        path = config.speculative_draft_model_path
        runner = load_draft_runner(
            path, load_config or LoadConfig(), cache_config, target, tokenizer
        )
    return ModelDrafter(runner, config.speculative_draft_steps, algorithm)


def _lookup_drafter(config: SchedulerConfig, algorithm: str) -> Drafter:
    """NGRAM or SUFFIX, with their flags."""
    if algorithm == "NGRAM":
        return NgramDrafter(
            config.speculative_num_draft_tokens,
            config.speculative_ngram_min_match_window_size,
            config.speculative_ngram_max_match_window_size,
            config.speculative_ngram_capacity,
        )
    return SuffixDrafter(
        config.speculative_num_draft_tokens,
        config.speculative_suffix_max_tree_depth,
        config.speculative_suffix_max_spec_factor,
        config.speculative_suffix_min_token_prob,
        config.speculative_suffix_max_cached_requests,
        config.speculative_suffix_max_cached_tokens,
    )


def _needs(target: ModelRunner | None, algorithm: str) -> ModelRunner:
    if target is None:
        raise ValueError(f"speculative_algorithm {algorithm} needs the target model's runner")
    return target
