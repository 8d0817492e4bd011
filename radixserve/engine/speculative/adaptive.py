"""Adaptive fallback: speculation only where it pays.

A verify step of K drafts costs more than a plain decode step (on CPU about 1.5x for K = 4
on the default model), so drafts that are mostly rejected make a request slower. Each
request keeps the accepted drafts per drafted step over a short window; below the
threshold it stops drafting for a while, twice as long each time it fails again (up to a
cap), then retries. Large decode batches do not speculate at all: there the step is
compute-bound and a verify row costs as much as another request's token.

    drafted steps:  |--window--| below? -> skip 16 | window | below? -> skip 32 | ...
                                 above? -> the next back-off halves
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from radixserve.engine.request import Req

# A request whose drafts never pay drafts in 10 of its first 256 decode steps (about 4%); on
# CPU a failed verify costs up to about one more decode step, so that bounds its overhead.
WINDOW_STEPS = 2  # drafted steps averaged before judging a request
FIRST_BACKOFF_STEPS = 16  # decode steps without drafting after the first failed window
MAX_BACKOFF_STEPS = 128  # the doubling stops here: a request retries at least this often


@dataclass
class Acceptance:
    """One request's recent acceptance and its back-off state."""

    window_steps: int = 0  # drafted verify steps in the current window
    window_accepted: int = 0  # drafts accepted in them
    skip_steps: int = 0  # decode steps left without drafting
    num_backoffs: int = 0  # consecutive failed windows


class AdaptivePolicy:
    """Decides per request and step whether to draft; learns from each verify outcome."""

    def __init__(self, threshold: float, disable_batch_size: int | None):
        self.threshold = threshold  # 0: never back off
        self.disable_batch_size = disable_batch_size
        self._state: weakref.WeakKeyDictionary[Req, Acceptance] = weakref.WeakKeyDictionary()

    def batch_speculates(self, num_decoding: int) -> bool:
        """False when the decode batch is too large for drafts to pay."""
        return self.disable_batch_size is None or num_decoding <= self.disable_batch_size

    def should_draft(self, req: Req) -> bool:
        """False while the request backs off (each call counts one decode step of it)."""
        state = self._state.get(req)
        if state is None or state.skip_steps == 0:
            return True
        state.skip_steps -= 1
        return False

    def record(self, req: Req, num_draft: int, num_accepted: int) -> None:
        """Learns from one verify step; steps without a draft cost nothing and do not count."""
        if num_draft == 0 or self.threshold <= 0:
            return
        state = self._state.setdefault(req, Acceptance())
        state.window_steps += 1
        state.window_accepted += num_accepted
        if state.window_steps < WINDOW_STEPS:
            return
        if state.window_accepted / state.window_steps < self.threshold:
            state.skip_steps = min(FIRST_BACKOFF_STEPS << state.num_backoffs, MAX_BACKOFF_STEPS)
            state.num_backoffs += 1
        else:  # a window that pays halves the next back-off (one lucky window is not a trend)
            state.num_backoffs = max(state.num_backoffs - 1, 0)
        state.window_steps = state.window_accepted = 0

    def state(self, req: Req) -> Acceptance | None:
        return self._state.get(req)
