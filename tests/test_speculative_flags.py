"""Speculative decoding's flags: a bad one fails naming the flag."""

from __future__ import annotations

import pytest
from speculative_common import NGRAM

from conftest import make_engine
from radixserve.config import SchedulerConfig


def test_bad_speculative_flags_fail_naming_the_flag(tiny_chat_model):
    cases = {
        "speculative_num_draft_tokens": dict(speculative_num_draft_tokens=0),
        "speculative_ngram_max_match_window_size": dict(
            speculative_ngram_min_match_window_size=4, speculative_ngram_max_match_window_size=2
        ),
        "speculative_algorithm must be NGRAM, SELF, STANDALONE": dict(
            speculative_algorithm="MEDUSA"
        ),
        "STANDALONE needs --speculative-draft-model-path": dict(speculative_algorithm="STANDALONE"),
        "speculative_draft_model_path needs --speculative-algorithm STANDALONE": dict(
            speculative_algorithm="SELF", speculative_draft_model_path="x"
        ),
        "speculative_num_steps needs": dict(speculative_num_steps=2),
        "speculative_num_steps must be between 1 and": dict(
            speculative_algorithm="SELF", speculative_num_steps=5
        ),
        "speculative_self_layers must be >= 1": dict(speculative_self_layers=0),
        "speculative_adaptive_threshold must be >= 0": dict(speculative_adaptive_threshold=-1),
        "speculative_disable_by_batch_size must be >= 1": dict(speculative_disable_by_batch_size=0),
    }
    for message, flags in cases.items():
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**(NGRAM | flags)).verify()
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        make_engine(tiny_chat_model, speculative_num_draft_tokens=-1, **NGRAM)
