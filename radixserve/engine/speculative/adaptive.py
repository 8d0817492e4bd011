"""Adaptive fallback: speculation only where it pays, by what a verify costs.

A verify step of k drafts costs more than a plain decode step: on CPU about 1 + 0.25 k
decode steps (CPU_VERIFY_ROW_COST, measured), so drafts that are mostly rejected make a
request slower. Each request keeps its accepted drafts and its verify cost over a short
window of drafted steps; a window pays when it averages at least `threshold` accepted
tokens per step and its tokens (accepted + 1 per step) at least cover its cost in decode
steps (sum of 1 + row_cost * k). A window that does not pay stops drafting for a while,
twice as long each time it fails again (up to a cap), then retries with a probe of
PROBE_DRAFT_TOKENS draft (cost 1.25 steps, not a full draft's 2) until a window pays
again. Large decode batches do not speculate at all: there the step is compute-bound and a
verify row costs as much as another request's token.

    drafted steps:  |--window--| pays? no -> skip 16 | probe window | no -> skip 32 | ...
                                                     | probe window | yes -> full drafts
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from radixserve.engine.request import Req

# A request whose drafts never pay drafts in 10 of its first 256 decode steps: its first
# window at full length (2 x 1 extra decode step at K = 4 on CPU), then probes of one token
# (0.25 each): about 1.5% over plain decoding where a full-length retry cost about 4%.
WINDOW_STEPS = 2  # drafted steps averaged before judging a request
FIRST_BACKOFF_STEPS = 16  # decode steps without drafting after the first failed window
MAX_BACKOFF_STEPS = 128  # the doubling stops here: a request retries at least this often
PROBE_DRAFT_TOKENS = 1  # most draft tokens of a request retrying after a back-off
# A verify row's cost in decode steps at batch 1 on CPU: benchmarks/verify_cost.py, default
# model (SmolLM2-135M Q4_1), context 256, one thread, thread CPU time: K = 1, 2, 4, 8 drafts
# cost 1.48, 1.24, 2.04, 2.98 decode steps (2-core Xeon under load, docs/performance.md);
# with verifies on the C++ decode stack, 1.20, 1.32, 1.76, 2.75 (quiet Zen 5 EPYC).
# Not measured on CUDA (verify rows are nearly free there): the policy takes 0 there.
CPU_VERIFY_ROW_COST = 0.25


@dataclass
class Acceptance:
    """One request's recent acceptance and its back-off state."""

    window_steps: int = 0  # drafted verify steps in the current window
    window_accepted: int = 0  # drafts accepted in them
    window_cost: float = 0.0  # their cost in decode steps (1 + row_cost * drafts each)
    skip_steps: int = 0  # decode steps left without drafting
    num_backoffs: int = 0  # consecutive failed windows
    probing: bool = False  # drafting probes since a failed window, until a window pays


class AdaptivePolicy:
    """Decides per request and step whether to draft; learns from each verify outcome."""

    def __init__(self, threshold: float, disable_batch_size: int | None, row_cost: float = 0.0):
        """`row_cost`: a verify row's cost in decode steps (CPU_VERIFY_ROW_COST on CPU; 0:
        verify rows are free, the threshold alone judges and retries draft in full)."""
        self.threshold = threshold  # 0: never back off
        self.disable_batch_size = disable_batch_size
        self.row_cost = row_cost
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

    def draft_limit(self, req: Req, num_draft_tokens: int) -> int:
        """Most draft tokens the request drafts this step: a probe after a failed window."""
        state = self._state.get(req)
        if state is not None and state.probing:
            return min(PROBE_DRAFT_TOKENS, num_draft_tokens)
        return num_draft_tokens

    def record(self, req: Req, num_draft: int, num_accepted: int) -> None:
        """Learns from one verify step; steps without a draft cost nothing and do not count."""
        if num_draft == 0 or self.threshold <= 0:
            return
        state = self._state.setdefault(req, Acceptance())
        state.window_steps += 1
        state.window_accepted += num_accepted
        state.window_cost += 1.0 + self.row_cost * num_draft
        if state.window_steps < WINDOW_STEPS:
            return
        tokens = state.window_accepted + state.window_steps  # + the target's own each step
        enough = state.window_accepted / state.window_steps >= self.threshold
        if not (enough and tokens >= state.window_cost):
            state.skip_steps = min(FIRST_BACKOFF_STEPS << state.num_backoffs, MAX_BACKOFF_STEPS)
            state.num_backoffs += 1
            state.probing = self.row_cost > 0
        else:  # a window that pays halves the next back-off (one lucky window is not a trend)
            state.num_backoffs = max(state.num_backoffs - 1, 0)
            state.probing = False
        state.window_steps = state.window_accepted = 0
        state.window_cost = 0.0

    def state(self, req: Req) -> Acceptance | None:
        return self._state.get(req)
