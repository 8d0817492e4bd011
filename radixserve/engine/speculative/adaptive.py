"""Adaptive fallback: speculation only where it pays, by what a verify costs.

A verify step of k drafts costs more than a plain decode step: on CPU 1 + c k decode steps,
where a row's cost c is learnt from this engine's own decode steps (`RowCostFit`; for the
default model ~0.2 on a Zen 5, 0.3-0.45 on a Zen 4; CPU_VERIFY_ROW_COST until measured), so
drafts that are mostly rejected make a request slower. Each request keeps its accepted
drafts and its verify cost over a short window of drafted steps; a window pays when it
averages at least `threshold` accepted tokens per step and its tokens (accepted + 1 per
step) at least cover its cost in decode steps (sum of 1 + row_cost * k). A window that does
not pay stops drafting for a while, twice as long each time it fails again (up to a cap),
then retries with a probe of PROBE_DRAFT_TOKENS draft (cost 1 + c steps, not a full
draft's 1 + 4c) until a window pays again. Large decode batches do not speculate at all:
there the step is compute-bound and a verify row costs as much as another request's token.

    drafted steps:  |--window--| pays? no -> skip 16 | probe window | no -> skip 32 | ...
                                                     | probe window | yes -> full drafts
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from radixserve.engine.request import Req

# A request whose drafts never pay drafts in 10 of its first 256 decode steps: its first
# window at full length (2 x 1 extra decode step at K = 4 on CPU), then probes of one token
# (0.25 each): about 1.5% over plain decoding where a full-length retry cost about 4%.
WINDOW_STEPS = 2  # drafted steps averaged before judging a request
FIRST_BACKOFF_STEPS = 16  # decode steps without drafting after the first failed window
MAX_BACKOFF_STEPS = 128  # the doubling stops here: a request retries at least this often
PROBE_DRAFT_TOKENS = 1  # most draft tokens of a request retrying after a back-off
# A verify row's cost in decode steps at batch 1 on CPU before RowCostFit has measured it:
# benchmarks/verify_cost.py, default model (SmolLM2-135M Q4_1), context 256, one thread:
# K = 1, 2, 4, 8 drafts cost 1.20, 1.32, 1.76, 2.75 decode steps on a quiet Zen 5 EPYC, but
# 1.6, 1.9, 2.8, 4.7 on a Zen 4 one (docs/performance.md): the machine decides, so it is
# measured. Not learnt on CUDA (rows are nearly free there, forwards asynchronous): 0 there.
CPU_VERIFY_ROW_COST = 0.25
ROW_COST_WEIGHT = 1 / 16  # the newest step's weight in the running means: follows the load
ROW_COST_MIN_STEPS = 4  # steps with drafts and without, each, before the measurement counts
ROW_COST_BOUNDS = (0.02, 2.0)  # a measurement outside them is noise
ROW_COST_MAX_BATCH = 64  # decode batches measured, at most (larger ones do not speculate)
ROW_COST_PAUSE = 4.0  # a step this many times slower than expected is a pause, not its rows
ROW_COST_MAX_PAUSES = 8  # ... unless so many come in a row: then the machine has slowed
# A model narrower than this (its hidden size) is test-sized: its steps are the interpreter's
# bookkeeping more than its rows (~1 ms idle, 4-200 ms at batch 4 on a loaded CI machine), so
# their timings would make the policy depend on the machine's load: it keeps the prior. The
# smallest served models are wider (SmolLM2-135M: 576). A step-time floor is no such bound:
# load stretches a tiny model's steps past any floor that real models' steps clear.
ROW_COST_MIN_HIDDEN_SIZE = 256


@dataclass
class RowCostFit:
    """A verify row's cost in decode steps, from this engine's decode-only steps: a running
    mean of a plain step's seconds per batch size, and of what a drafted step took beyond
    its batch's plain step per draft row (the verify's rows, its drafting and bookkeeping),
    so that a row costs extra / plain(batch) of a step. `prior` until both kinds of step
    have been seen at the batch size asked about."""

    prior: float
    plain_seconds: dict[int, float] = field(default_factory=dict)  # batch -> a plain step
    row_seconds: float | None = None  # a draft row's extra seconds
    plain_steps: int = 0
    drafted_steps: int = 0
    pauses: int = 0  # steps dropped as pauses since the last one kept

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        """One decode-only step of `batch` requests that computed `rows` rows."""
        if not 0 < batch <= ROW_COST_MAX_BATCH:
            return
        plain = self.plain_seconds.get(batch)
        drafted = rows > batch
        if plain is not None and (not drafted or self.row_seconds is not None):
            expected = plain + max(self.row_seconds or 0.0, 0.0) * (rows - batch)
            if seconds > ROW_COST_PAUSE * expected and self.pauses < ROW_COST_MAX_PAUSES:
                self.pauses += 1
                return  # a pause (GC, a preempted core), not what rows cost
        self.pauses = 0
        if not drafted:
            self.plain_seconds[batch] = _mean(plain, seconds)
            self.plain_steps += 1
        elif plain is not None:
            self.row_seconds = _mean(self.row_seconds, (seconds - plain) / (rows - batch))
            self.drafted_steps += 1

    def row_cost(self, batch: int) -> float:
        """A verify row's cost in decode steps of a `batch`-request step."""
        plain = self.plain_seconds.get(batch)
        if not self.measured or plain is None:
            return self.prior
        low, high = ROW_COST_BOUNDS
        return min(max(self.row_seconds / plain, low), high)

    @property
    def measured(self) -> bool:
        return min(self.plain_steps, self.drafted_steps) >= ROW_COST_MIN_STEPS


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + ROW_COST_WEIGHT * (new - old)


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
