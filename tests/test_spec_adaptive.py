"""Speculative decoding's adaptive fallback: requests whose drafts stop paying back off
(and retry later), large decode batches do not speculate; outputs never change."""

from __future__ import annotations

import pytest

from conftest import VOCAB, greedy, make_engine, prompt_ids
from radixserve.engine.request import Req
from radixserve.engine.speculative import Drafter
from radixserve.engine.speculative.adaptive import (
    FIRST_BACKOFF_STEPS,
    MAX_BACKOFF_STEPS,
    WINDOW_STEPS,
    AdaptivePolicy,
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
