"""AUTO drafting (ours): per request, whichever candidate drafter has been accepting best.

Candidates: NGRAM and SUFFIX always (lookups: cheap, no model), EAGLE3 given a head.

    a drafted step of a request
      lookups        every lookup candidate proposes (a "shadow" unless picked)
      pick           the best-scoring candidate with a non-empty draft; the model
                     candidate proposes only where it would be picked (untried, or not
                     picked for RETRY_STEPS drafted steps, ranks first)
      verify         the pick's draft, in the running batch as any other
      score          the pick: its accepted tokens; a shadow: how many of the tokens the
                     step emitted its draft begins with (exact below the pick's + 1, so
                     which of the two would have accepted more is always known; a shadow
                     that matches them all counts pick + 1, a lower bound)
    scores           per request and candidate, an exponentially weighted mean of those
    no candidate     the adaptive policy (adaptive.py) judges the request by the best count
    pays             of each step, so a request backs off (no lookups either) only when
                     no candidate would have paid: the same cost model as one algorithm
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

from radixserve.engine.request import Req
from radixserve.engine.speculative.drafter import Draft, Drafter
from radixserve.model.runner import LogitsOutput

# 0.3: a request of 128 tokens drafts 30-100 times; the newest step weighs 0.3, the ones
# three steps back 0.1, so a change of phase (quoting -> free text) shows within a few steps
SCORE_WEIGHT = 0.3
# 32 drafted steps: a model candidate costs a draft forward per try, so a request that left
# it retries it about as rarely as the adaptive policy retries a request that backed off
RETRY_STEPS = 32


@dataclass
class AutoState:
    """One request's scores, and the drafts of its step in flight."""

    scores: dict[str, float] = field(default_factory=dict)  # absent: never scored
    since_model: int = 0  # drafted steps since the model candidate was last picked
    num_output: int = 0  # len(output_ids) when the drafts in flight were proposed
    picked: str | None = None  # None: nothing in flight
    drafts: dict[str, list[int]] = field(default_factory=dict)  # non-empty proposals


class AutoDrafter(Drafter):
    """Picks, per request and step, among `lookups` (proposing every step) and an optional
    `model` drafter (proposing only when picked)."""

    algorithm = "AUTO"

    def __init__(self, lookups: list[Drafter], model: Drafter | None = None):
        self.lookups, self.model = lookups, model
        self.candidates = ([] if model is None else [model]) + lookups  # ties: this order
        self.num_draft_tokens = max(c.num_draft_tokens for c in self.candidates)
        self._states: weakref.WeakKeyDictionary[Req, AutoState] = weakref.WeakKeyDictionary()

    def propose(self, req: Req) -> list[int]:
        return self.propose_all([req])[0].tokens

    def propose_all(self, reqs: list[Req], max_tokens: list[int] | None = None) -> list[Draft]:
        """Every candidate drafts in full whatever `max_tokens` says: each is scored on how
        much of what was emitted its own draft foresaw, the token after a cut draft too."""
        states = [self._states.setdefault(r, AutoState()) for r in reqs]
        proposals = [{} for _ in reqs]
        for lookup in self.lookups:
            for proposal, draft in zip(proposals, lookup.propose_all(reqs)):
                if draft.tokens:
                    proposal[lookup.algorithm] = draft
        if self.model is not None:
            wanting = [i for i, s in enumerate(states) if self._wants_model(s, proposals[i])]
            drafts = self.model.propose_all([reqs[i] for i in wanting]) if wanting else []
            for i, draft in zip(wanting, drafts):
                if draft.tokens:
                    proposals[i][self.model.algorithm] = draft
        return [self._pick(r, s, p) for r, s, p in zip(reqs, states, proposals)]

    def on_verified(self, req: Req, num_draft: int, num_accepted: int) -> int:
        """Scores every candidate that proposed for this step; returns the best count."""
        state = self._states.get(req)
        if state is None or state.picked is None or num_draft == 0:
            if state is not None:  # a pick that was not verified (no room, no free pages)
                state.picked = None
            return num_accepted
        emitted = req.output_ids[state.num_output :]
        counts = {name: _common_prefix(d, emitted) for name, d in state.drafts.items()}
        counts[state.picked] = num_accepted
        if self.model is not None:
            picked_model = state.picked == self.model.algorithm
            state.since_model = 0 if picked_model else state.since_model + 1
        for name, count in counts.items():
            old = state.scores.get(name)
            state.scores[name] = count if old is None else old + SCORE_WEIGHT * (count - old)
        state.picked, state.drafts = None, {}
        return max(counts.values())

    def scores(self, req: Req) -> dict[str, float]:
        """The request's current score per candidate (accepted tokens per drafted step)."""
        state = self._states.get(req)
        return {} if state is None else dict(state.scores)

    def on_forward(
        self,
        reqs: list[Req],
        starts: list[int],
        lengths: list[int],
        logits: LogitsOutput,
        trees: list[Draft | None] | None = None,
    ) -> None:
        for candidate in self.candidates:
            candidate.on_forward(reqs, starts, lengths, logits, trees)

    def on_finished(self, req: Req) -> None:
        for candidate in self.candidates:
            candidate.on_finished(req)

    def release(self, req: Req) -> None:
        for candidate in self.candidates:
            candidate.release(req)
        self._states.pop(req, None)

    def _rank(self, state: AutoState, name: str) -> float:
        if name == getattr(self.model, "algorithm", None) and state.since_model >= RETRY_STEPS:
            return math.inf  # retried: scored afresh by its next count
        return state.scores.get(name, math.inf)

    def _wants_model(self, state: AutoState, proposal: dict[str, Draft]) -> bool:
        """Whether the model candidate would be picked over every lookup's draft."""
        model_rank = self._rank(state, self.model.algorithm)
        if state.since_model >= RETRY_STEPS:
            state.scores.pop(self.model.algorithm, None)
        return all(model_rank >= self._rank(state, name) for name in proposal)

    def _pick(self, req: Req, state: AutoState, proposal: dict[str, Draft]) -> Draft:
        state.num_output = len(req.output_ids)
        state.drafts = {name: d.tokens for name, d in proposal.items()}
        ranked = [c.algorithm for c in self.candidates if c.algorithm in proposal]
        if not ranked:
            state.picked = None
            return Draft([])
        state.picked = max(ranked, key=lambda name: self._rank(state, name))  # first on a tie
        draft = proposal[state.picked]
        return Draft(draft.tokens, draft.probs, source=state.picked)


def _common_prefix(draft: list[int], emitted: list[int]) -> int:
    """How many of `draft`'s tokens the emitted tokens begin with."""
    num = 0
    for drafted, token in zip(draft, emitted):
        if drafted != token:
            break
        num += 1
    return num
