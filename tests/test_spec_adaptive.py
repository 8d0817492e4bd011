"""Speculative decoding's adaptive fallback: requests whose drafts stop paying back off
(and retry later), large decode batches do not speculate; outputs never change."""

from __future__ import annotations

import pytest

from conftest import VOCAB, greedy, make_engine, prompt_ids
from radixserve.engine.request import Req
from radixserve.engine.speculative import Drafter
from radixserve.engine.speculative.adaptive import (
    CPU_VERIFY_ROW_COST,
    FIRST_BACKOFF_STEPS,
    MAX_BACKOFF_STEPS,
    PROBE_DRAFT_TOKENS,
    ROW_COST_BOUNDS,
    ROW_COST_MAX_PAUSES,
    ROW_COST_MIN_HIDDEN_SIZE,
    ROW_COST_MIN_STEPS,
    WINDOW_STEPS,
    AdaptivePolicy,
    RowCostFit,
)
from radixserve.sampling.params import SamplingParams

NGRAM = {"speculative_algorithm": "NGRAM"}


class CountingWrongDrafter(Drafter):
    """Always proposes K tokens, always wrong (no greedy output repeats a token + 1 run)."""

    num_draft_tokens = 3

    def __init__(self):
        self.proposed = 0

    def propose(self, req: Req) -> list[int]:
        self.proposed += 1
        return [(req.seq_ids()[-1] + 1 + i) % VOCAB for i in range(self.num_draft_tokens)]


def _req() -> Req:
    return Req("r", [1, 2, 3], SamplingParams(max_new_tokens=500), seed=0)


def _skipped(policy: AdaptivePolicy, req: Req) -> int:
    """Decode steps until the request drafts again."""
    num = 0
    while not policy.should_draft(req):
        num += 1
    return num


def test_backoff_doubles_on_each_failed_window_and_resets_when_drafts_pay():
    policy, req = AdaptivePolicy(threshold=0.5, disable_batch_size=None), _req()
    assert policy.should_draft(req)
    for expected in [FIRST_BACKOFF_STEPS, 2 * FIRST_BACKOFF_STEPS, 4 * FIRST_BACKOFF_STEPS]:
        for _ in range(WINDOW_STEPS):
            assert policy.should_draft(req)
            policy.record(req, num_draft=4, num_accepted=0)
        assert _skipped(policy, req) == expected
    for _ in range(WINDOW_STEPS):  # a window that pays: the next back-off halves
        policy.record(req, num_draft=4, num_accepted=1)
    assert policy.should_draft(req) and policy.state(req).num_backoffs == 2
    for _ in range(WINDOW_STEPS):
        policy.record(req, num_draft=4, num_accepted=0)
    assert _skipped(policy, req) == 4 * FIRST_BACKOFF_STEPS
    policy.state(req).num_backoffs = 30  # the doubling is capped
    for _ in range(WINDOW_STEPS):
        policy.record(req, num_draft=4, num_accepted=0)
    assert _skipped(policy, req) == MAX_BACKOFF_STEPS


def test_the_verify_cost_judges_long_drafts_and_retries_probe_with_one_token():
    """Row cost 0.25 (CPU): 1.5 accepted of 8 drafts per step passes threshold 1 but buys
    2.5 tokens for 3 decode steps' cost, so it backs off; the retry drafts one token, and a
    window of accepted probes (2 tokens for 1.25 steps each) restores full drafts."""
    policy, req = AdaptivePolicy(1.0, None, CPU_VERIFY_ROW_COST), _req()
    assert policy.draft_limit(req, 8) == 8
    for accepted in (1, 2):
        policy.record(req, num_draft=8, num_accepted=accepted)
    assert _skipped(policy, req) == FIRST_BACKOFF_STEPS
    assert policy.draft_limit(req, 8) == PROBE_DRAFT_TOKENS == 1
    for _ in range(WINDOW_STEPS):
        policy.record(req, num_draft=1, num_accepted=1)
    assert policy.should_draft(req) and policy.draft_limit(req, 8) == 8
    for _ in range(WINDOW_STEPS):  # 4 of 4 drafts: 5 tokens for 2 steps' cost each, pays
        policy.record(req, num_draft=4, num_accepted=4)
    assert policy.should_draft(req) and policy.draft_limit(req, 4) == 4
    free = AdaptivePolicy(1.0, None, row_cost=0.0)  # rows free (not CPU): threshold only
    for accepted in (1, 2):
        free.record(req, num_draft=8, num_accepted=accepted)
    assert free.should_draft(req) and free.draft_limit(req, 8) == 8


def test_the_row_cost_is_measured_from_the_steps_seconds():
    """Steps of a + b * rows seconds (a = 10 ms reading the weights, b = 2 ms a row, +-3%
    noise): a draft row costs b / (a + b) of a 1-request step, b / (a + 4b) of a 4-request
    one; the prior holds until steps with drafts and without have both been seen."""
    fit = RowCostFit(prior=CPU_VERIFY_ROW_COST)
    for i in range(3 * ROW_COST_MIN_STEPS):  # plain steps only: nothing drafted yet
        fit.observe(1, 1, 0.012 * (1 + 0.03 * (-1) ** i))
    assert fit.row_cost(1) == CPU_VERIFY_ROW_COST and not fit.measured
    for i in range(40):
        rows = 1 + (i % 5) * 2  # verifies of 0, 2, 4, 6, 8 drafts, 1-row steps among them
        fit.observe(1, rows, (0.010 + 0.002 * rows) * (1 + 0.03 * (-1) ** (i // 5)))
        fit.observe(4, 4 + i % 3, 0.010 + 0.002 * (4 + i % 3))
    assert fit.measured
    assert fit.row_cost(1) == pytest.approx(0.002 / 0.012, rel=0.15)
    assert fit.row_cost(4) == pytest.approx(0.002 / 0.018, rel=0.15)
    assert fit.row_cost(2) == CPU_VERIFY_ROW_COST  # no plain step of 2 requests seen
    before = fit.row_cost(1)
    fit.observe(1, 1, 2.0)  # a GC pause: not what a row costs
    assert fit.row_cost(1) == before
    for _ in range(ROW_COST_MAX_PAUSES + 1):  # but a machine slowed for good is followed
        fit.observe(1, 1, 0.2)
    assert fit.plain_seconds[1] > 0.02
    # a machine where rows cost almost nothing: held at the lower bound, never 0
    cheap = RowCostFit(prior=CPU_VERIFY_ROW_COST)
    for i in range(4 * ROW_COST_MIN_STEPS):
        cheap.observe(1, 1 + i % 2, 0.010)
    assert cheap.row_cost(1) == ROW_COST_BOUNDS[0]


class EveryOtherStepDrafter(CountingWrongDrafter):
    """Wrong drafts on every other decode step, none between: plain and drafted steps."""

    def propose(self, req: Req) -> list[int]:
        return super().propose(req) if len(req.output_ids) % 2 else []


def test_the_engine_learns_the_row_cost_from_its_own_forwards(tiny_chat_model, monkeypatch):
    # a test-sized model's steps are the machine's load, not its rows: it keeps the prior
    tiny = make_engine(tiny_chat_model, speculative_adaptive_threshold=0.0, **NGRAM)
    tiny.scheduler.drafter = EveryOtherStepDrafter()
    tiny.generate(input_ids=[prompt_ids(0, 20)], sampling_params=greedy(40))
    assert tiny.scheduler.speculator.row_costs is None
    assert tiny.scheduler.speculator.policy.row_cost == CPU_VERIFY_ROW_COST
    assert tiny.runner.config.hidden_size < ROW_COST_MIN_HIDDEN_SIZE
    # lifted here, so that the tiny model's steps are measured
    monkeypatch.setattr("radixserve.engine.speculative.speculator.ROW_COST_MIN_HIDDEN_SIZE", 0)
    # threshold 0: the policy never backs off, so both kinds of step keep coming (a step a
    # busy machine preempts is dropped as a pause; there are dozens of each)
    spec = make_engine(tiny_chat_model, speculative_adaptive_threshold=0.0, **NGRAM)
    spec.scheduler.drafter = EveryOtherStepDrafter()
    spec.generate(input_ids=[prompt_ids(0, 20)], sampling_params=greedy(80))
    speculator = spec.scheduler.speculator
    fit = speculator.row_costs
    assert fit.measured and fit.drafted_steps >= 20 and fit.plain_steps >= 20
    learnt = fit.row_cost(1)
    assert ROW_COST_BOUNDS[0] <= learnt <= ROW_COST_BOUNDS[1]
    # what the policy judges by: set from the measurement at each step's start (which has
    # learnt from that step since)
    assert speculator.policy.row_cost != CPU_VERIFY_ROW_COST
    assert speculator.policy.row_cost == pytest.approx(learnt, rel=0.5)


def test_steps_without_a_draft_do_not_count_and_threshold_zero_never_backs_off():
    policy, req = AdaptivePolicy(threshold=0.5, disable_batch_size=None), _req()
    for _ in range(10 * WINDOW_STEPS):
        policy.record(req, num_draft=0, num_accepted=0)
    assert policy.should_draft(req)
    never = AdaptivePolicy(threshold=0.0, disable_batch_size=None)
    for _ in range(10 * WINDOW_STEPS):
        never.record(req, num_draft=4, num_accepted=0)
    assert never.should_draft(req)
    assert AdaptivePolicy(0.5, disable_batch_size=4).batch_speculates(4)
    assert not AdaptivePolicy(0.5, disable_batch_size=4).batch_speculates(5)


def test_wrong_drafts_back_off_and_outputs_and_pages_stay_exact(tiny_chat_model):
    prompts = [prompt_ids(i, 20 + 9 * i) for i in range(3)]
    expected = make_engine(tiny_chat_model).generate(input_ids=prompts, sampling_params=greedy(80))
    proposals = {}
    for threshold in (0.0, 0.5):
        spec = make_engine(tiny_chat_model, speculative_adaptive_threshold=threshold, **NGRAM)
        initial_free = spec.runner.pool.allocator.num_free
        drafter = spec.scheduler.drafter = CountingWrongDrafter()
        outputs = spec.generate(input_ids=prompts, sampling_params=greedy(80))
        assert [o["output_ids"] for o in outputs] == [e["output_ids"] for e in expected]
        assert all(o["meta_info"]["spec_verify_ct"] == 79 for o in outputs)
        proposals[threshold] = drafter.proposed
        spec.check_integrity()
        assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free
    # 3 requests x 78 decode steps with room for a draft (the last has none); backing off:
    # windows of 4 drafted steps between 8, 16, 32 skipped ones
    assert proposals[0.0] == 3 * 78
    assert 3 * 4 * WINDOW_STEPS >= proposals[0.5] >= 3 * 3 * WINDOW_STEPS


@pytest.mark.parametrize("limit, speculates", [(2, False), (3, True)])
def test_large_decode_batches_do_not_speculate(tiny_chat_model, limit, speculates):
    prompts = [prompt_ids(i, 24) for i in range(3)]
    spec = make_engine(
        tiny_chat_model,
        speculative_disable_by_batch_size=limit,
        speculative_adaptive_threshold=0,
        **NGRAM,
    )
    drafter = spec.scheduler.drafter = CountingWrongDrafter()
    outputs = spec.generate(input_ids=prompts, sampling_params=greedy(12))
    assert (drafter.proposed > 0) is speculates
    assert all(o["meta_info"]["spec_verify_ct"] == 11 for o in outputs)
    one = spec.generate(input_ids=prompts[0], sampling_params=greedy(12))  # alone: it drafts
    assert one["meta_info"]["spec_draft_token_num"] > 0
    assert one["output_ids"] == outputs[0]["output_ids"]


class FailingDrafter(Drafter):
    num_draft_tokens = 3

    def propose(self, req: Req) -> list[int]:
        raise RuntimeError("draft model broke")


def test_a_failing_drafter_costs_the_drafts_only(tiny_chat_model):
    prompts = [prompt_ids(i, 24) for i in range(2)]
    expected = make_engine(tiny_chat_model).generate(input_ids=prompts, sampling_params=greedy(10))
    spec = make_engine(tiny_chat_model, **NGRAM)
    spec.scheduler.drafter = FailingDrafter()
    outputs = spec.generate(input_ids=prompts, sampling_params=greedy(10))
    assert [o["output_ids"] for o in outputs] == [e["output_ids"] for e in expected]
    assert spec.get_stats()["spec_draft_tokens"] == 0
    spec.check_integrity()
