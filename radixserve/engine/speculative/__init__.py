"""Speculative decoding: a `Drafter` proposes tokens, the running batch verifies them in
one forward (K + 1 extend tokens per speculating request), the `Verifier` keeps a prefix.

    scheduler decode phase      drafter.propose(req) -> K tokens   (ngram.py: NGRAM)
    batch_builder               [last token, d1 .. dK] over the request's cached prefix
    model forward               logits at the K + 1 rows (LogitsOutput.verify)
    verifier                    accepted drafts + the target's token (lossless rule)
    req_pages.trim              frees the rejected tail's emptied pages
"""

from __future__ import annotations

from radixserve.config import SchedulerConfig
from radixserve.engine.speculative.drafter import Drafter
from radixserve.engine.speculative.ngram import NgramDrafter
from radixserve.engine.speculative.verifier import Verified, Verifier

__all__ = ["Drafter", "NgramDrafter", "Verified", "Verifier", "create_drafter"]


def create_drafter(config: SchedulerConfig) -> Drafter | None:
    """The drafter `config.speculative_algorithm` names; None when speculation is off."""
    if config.speculative_algorithm is None:
        return None
    config.verify()  # names the flag of an unknown or not yet supported algorithm
    return NgramDrafter(
        config.speculative_num_draft_tokens,
        config.speculative_ngram_min_match_window_size,
        config.speculative_ngram_max_match_window_size,
        config.speculative_ngram_capacity,
    )
