"""NewTokenRatio: how much of each running request's remaining max_new_tokens admission
reserves pages for. It starts cautious, decays as batches run, and jumps back after a
retraction. The numbers are SGLang's (its SGLANG_* environment defaults)."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.engine.request import Req

INIT_RATIO_PER_CONSERVATIVENESS = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR: floor = init * this
DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS: init -> floor over this many batches
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS: tokens assumed per request after


class NewTokenRatio:
    def __init__(self, schedule_conservativeness: float):
        self.init = min(INIT_RATIO_PER_CONSERVATIVENESS * schedule_conservativeness, 1.0)
        self.min = self.init * MIN_RATIO_FACTOR
        self.value = self.init

    def decay(self) -> None:
        """One batch ran without a retraction: reserve a little less."""
        step = (self.init - self.min) / DECAY_STEPS
        self.value = max(self.value - step, self.min)

    def reset_after_retraction(self, running: Sequence[Req]) -> None:
        """Memory ran out: reserve at least what the running requests are on course to use."""
        decoded = sum(len(r.output_ids) for r in running)
        total = sum(r.params.max_new_tokens for r in running)
        ratio = (decoded + RETRACT_DECODE_STEPS * len(running)) / (total + 1)
        self.value = min(max(ratio, self.value), 1.0)
