"""Speculative decoding's options: the algorithms and the checks of their flags.

The flags themselves are fields of SchedulerConfig (speculation runs in the scheduler's decode
phase, and `--help` lists them in its group); this module says which combinations are valid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.config.scheduler import SchedulerConfig

SPECULATIVE_ALGORITHMS = ("NGRAM", "SELF", "STANDALONE")  # SGLang's names (SELF: ours)
DRAFT_MODEL_ALGORITHMS = ("SELF", "STANDALONE")


def verify_speculative(config: SchedulerConfig) -> None:
    """Rejects bad speculative flags, naming them; upper-cases --speculative-algorithm."""
    algorithm = config.speculative_algorithm
    if algorithm is None:
        return
    if algorithm.upper() not in SPECULATIVE_ALGORITHMS:
        raise ValueError(
            f"speculative_algorithm must be NGRAM, SELF, STANDALONE or unset; got {algorithm!r}"
        )
    config.speculative_algorithm = algorithm.upper()
    _verify_limits(config)
    _verify_draft_model(config)


def _verify_limits(config: SchedulerConfig) -> None:
    for name in (
        "speculative_num_draft_tokens",
        "speculative_ngram_min_match_window_size",
        "speculative_ngram_capacity",
        "speculative_self_layers",
    ):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1; got {getattr(config, name)}")
    low = config.speculative_ngram_min_match_window_size
    high = config.speculative_ngram_max_match_window_size
    if high < low:
        raise ValueError(
            "speculative_ngram_max_match_window_size must be >= "
            f"speculative_ngram_min_match_window_size ({low}); got {high}"
        )
    if config.speculative_adaptive_threshold < 0:
        raise ValueError(
            "speculative_adaptive_threshold must be >= 0; "
            f"got {config.speculative_adaptive_threshold}"
        )
    limit = config.speculative_disable_by_batch_size
    if limit is not None and limit < 1:
        raise ValueError(f"speculative_disable_by_batch_size must be >= 1; got {limit}")


def _verify_draft_model(config: SchedulerConfig) -> None:
    """The flags of SELF / STANDALONE: each only with the algorithm that reads it."""
    algorithm = config.speculative_algorithm
    steps = config.speculative_num_steps
    if steps is not None and algorithm not in DRAFT_MODEL_ALGORITHMS:
        raise ValueError("speculative_num_steps needs --speculative-algorithm SELF or STANDALONE")
    if steps is not None and not 1 <= steps <= config.speculative_num_draft_tokens:
        raise ValueError(
            "speculative_num_steps must be between 1 and speculative_num_draft_tokens "
            f"({config.speculative_num_draft_tokens}); got {steps}"
        )
    path = config.speculative_draft_model_path
    if algorithm == "STANDALONE" and path is None:
        raise ValueError("speculative_algorithm STANDALONE needs --speculative-draft-model-path")
    if algorithm != "STANDALONE" and path is not None:
        raise ValueError("speculative_draft_model_path needs --speculative-algorithm STANDALONE")
