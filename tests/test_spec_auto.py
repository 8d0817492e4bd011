"""AUTO speculative decoding: per request, whichever of NGRAM, SUFFIX (and EAGLE3, given a
head) has been accepting best. Greedy outputs equal plain decoding's; meta_info counts the
steps each drafted; where one method clearly wins AUTO drafts with it; tenants never draft
from each other; flags that do not fit fail at start naming the flag."""

from __future__ import annotations

import pytest
from test_spec_eagle import _echo_head, _save_target

from conftest import greedy, make_engine, prompt_ids
from radixserve.config import SchedulerConfig
from radixserve.engine.request import Req
from radixserve.engine.speculative import AutoDrafter, Drafter
from radixserve.engine.speculative.auto import RETRY_STEPS
from radixserve.sampling.params import SamplingParams

AUTO = {"speculative_algorithm": "AUTO"}
PROMPTS = [prompt_ids(i, 20 + 23 * i) for i in range(4)]


def _ids(outputs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def _drafted(outputs: list[dict]) -> dict[str, int]:
    """Verify steps per algorithm that drafted, over all `outputs`."""
    total: dict[str, int] = {}
    for out in outputs:
        for name, num in out["meta_info"]["spec_drafter_verify_ct"].items():
            total[name] = total.get(name, 0) + num
    return total


@pytest.fixture(scope="module")
def expected(tiny_chat_model) -> list[list[int]]:
    plain = make_engine(tiny_chat_model)
    return _ids(plain.generate(input_ids=PROMPTS, sampling_params=greedy(40)))


# ---- the choice, without an engine ---------------------------------------------------------


class FixedDrafter(Drafter):
    """Drafts `tokens` from the end of whatever it is asked about (a lookup stand-in)."""

    def __init__(self, algorithm: str, tokens: list[int]):
        self.algorithm, self.tokens, self.num_draft_tokens = algorithm, tokens, 4

    def propose(self, req: Req) -> list[int]:
        return list(self.tokens)


def test_shadows_are_scored_against_the_output_and_the_best_count_is_returned():
    req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=100), seed=0)
    right, wrong = FixedDrafter("RIGHT", [7, 8, 9, 10]), FixedDrafter("WRONG", [5, 5, 5])
    auto = AutoDrafter([wrong, right])  # a tie picks the first: WRONG
    draft = auto.propose_all([req])[0]
    assert draft.tokens == [5, 5, 5] and draft.source == "WRONG"
    req.output_ids.append(7)  # the target rejected every draft token and emitted 7
    assert auto.on_verified(req, num_draft=3, num_accepted=0) == 1  # RIGHT: 1 (of at most 1)
    assert auto.scores(req) == {"WRONG": 0, "RIGHT": 1}
    draft = auto.propose_all([req])[0]
    assert draft.source == "RIGHT"
    req.output_ids += [7, 8, 9, 10, 11]
    assert auto.on_verified(req, num_draft=4, num_accepted=4) == 4
    assert auto.scores(req)["RIGHT"] == pytest.approx(1 + 0.3 * 3)
    auto.propose_all([req])
    assert auto.on_verified(req, num_draft=0, num_accepted=0) == 0  # dropped: nothing learnt
    assert auto.scores(req)["RIGHT"] == pytest.approx(1.9)
    nothing = AutoDrafter([FixedDrafter("EMPTY", [])])
    assert nothing.propose_all([req])[0].tokens == []


def test_the_model_candidate_is_tried_first_then_only_when_it_leads_or_is_due():
    req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=500), seed=0)
    model, lookup = FixedDrafter("MODEL", [0, 0]), FixedDrafter("LOOKUP", [9])
    model.calls = 0
    propose_all = model.propose_all

    def counting(reqs, max_tokens=None):
        model.calls += 1
        return propose_all(reqs, max_tokens)

    model.propose_all = counting
    auto = AutoDrafter([lookup], model)
    picks = []
    for _ in range(2 * RETRY_STEPS + 2):
        draft = auto.propose_all([req])[0]
        picks.append(draft.source)
        req.output_ids += [9, 9]  # the lookup's draft is right, the model's never
        accepted = 1 if draft.source == "LOOKUP" else 0
        auto.on_verified(req, len(draft.tokens), accepted)
    assert picks[0] == "MODEL" and picks[1] == "LOOKUP"
    assert [i for i, p in enumerate(picks) if p == "MODEL"] == [0, RETRY_STEPS + 1]
    assert model.calls == 2  # it proposes only where it is picked


# ---- end to end ----------------------------------------------------------------------------


NEVER_BACK_OFF = {"speculative_adaptive_threshold": 0.0}
"""What drafts and what they accept is compared here, not the verify's cost, which the
engine learns from step times once a step takes over 2 ms (a tiny model's does on a loaded
or AVX2-only machine; then AUTO backs off and the warm accept lengths read ~1)."""


@pytest.fixture(scope="module")
def auto_engine(tiny_chat_model):
    return make_engine(
        tiny_chat_model, page_size=1, chunked_prefill_size=32, **AUTO, **NEVER_BACK_OFF
    )


def test_auto_matches_plain_decoding_cold_and_warm_and_reports_its_drafters(auto_engine, expected):
    initial_free = auto_engine.runner.pool.allocator.num_free
    cold = auto_engine.generate(input_ids=PROMPTS, sampling_params=greedy(40))
    warm = auto_engine.generate(input_ids=PROMPTS, sampling_params=greedy(40))
    assert _ids(cold) == _ids(warm) == expected
    for out in cold + warm:
        meta = out["meta_info"]
        assert sum(meta["spec_drafter_verify_ct"].values()) == meta["spec_verify_ct"]
        assert set(meta["spec_drafter_verify_ct"]) <= {"NGRAM", "SUFFIX", "none"}
        by_drafter = meta["spec_drafter_accept_token_num"]
        assert sum(by_drafter.values()) == meta["spec_accept_token_num"]
    warm_drafted = _drafted(warm)
    assert warm_drafted.get("NGRAM", 0) + warm_drafted.get("SUFFIX", 0) > 0
    assert all(o["meta_info"]["spec_accept_length"] > 1.5 for o in warm)  # earlier outputs
    auto_engine.check_integrity()
    assert auto_engine.flush_cache()
    assert auto_engine.runner.pool.allocator.num_free == initial_free


def test_tenants_never_draft_from_each_other_under_auto(tiny_chat_model, auto_engine):
    prompt = prompt_ids(9, 30)
    plain = make_engine(tiny_chat_model)
    reference = plain.generate(input_ids=prompt, sampling_params=greedy(40))["output_ids"]

    def accepted(salt: str) -> int:
        out = auto_engine.generate(input_ids=prompt, sampling_params=greedy(40), cache_salt=salt)
        assert out["output_ids"] == reference
        return out["meta_info"]["spec_accept_token_num"]

    cold = accepted("tenant-a")
    assert accepted("tenant-b") == cold  # b's stores are empty: its own sequence only
    assert accepted("tenant-a") > cold + 20  # a's second run drafts from a's first


@pytest.mark.parametrize("winner", ["SUFFIX", "NGRAM"])
def test_auto_drafts_with_the_method_that_clearly_wins(tiny_chat_model, expected, winner):
    """SUFFIX: repeated requests with NGRAM's store too small to hold anything (SUFFIX's
    keeps the outputs). NGRAM: the continuations were quoted in earlier prompts, which
    NGRAM's store indexes and SUFFIX's (outputs only) does not. Both run with the back-off
    off (threshold 0): which drafts pay is what is compared here, not the verify's cost,
    which the engine learns from step times once a step takes over 2 ms (a tiny model's does
    on a loaded machine: SUFFIX alone backed off to 22 accepted tokens there)."""
    never_back_off = NEVER_BACK_OFF
    if winner == "SUFFIX":
        flags, warmup = never_back_off | {"speculative_ngram_capacity": 1}, (PROMPTS, 40)
    else:
        quoted = [p + out for p, out in zip(PROMPTS, expected)]
        flags = never_back_off | {"speculative_ngram_min_match_window_size": 3}
        warmup = (quoted, 4)
    results = {}
    for algorithm in (winner, "AUTO"):
        spec = make_engine(tiny_chat_model, speculative_algorithm=algorithm, **flags)
        spec.generate(input_ids=warmup[0], sampling_params=greedy(warmup[1]))
        outputs = spec.generate(input_ids=PROMPTS, sampling_params=greedy(40))
        assert _ids(outputs) == expected
        results[algorithm] = outputs
    drafted = _drafted(results["AUTO"])
    loser = {"SUFFIX": "NGRAM", "NGRAM": "SUFFIX"}[winner]
    assert drafted[winner] > 4 * drafted.get(loser, 0)
    alone = sum(o["meta_info"]["spec_accept_token_num"] for o in results[winner])
    auto = sum(o["meta_info"]["spec_accept_token_num"] for o in results["AUTO"])
    assert alone > 100 and auto >= 0.9 * alone


def test_auto_with_an_eagle3_head_explores_it_and_keeps_greedy_outputs(tmp_path):
    target, head = _save_target(tmp_path / "target"), _echo_head(tmp_path / "echo")
    prompts = [prompt_ids(i, 20 + 11 * i) for i in range(3)]
    plain = make_engine(target).generate(input_ids=prompts, sampling_params=greedy(30))
    flags = AUTO | {"speculative_draft_model_path": head, "speculative_num_steps": 2}
    spec = make_engine(target, **flags)
    drafter = spec.scheduler.drafter
    assert isinstance(drafter, AutoDrafter) and drafter.model.num_draft_tokens == 2
    outputs = spec.generate(input_ids=prompts, sampling_params=greedy(30))
    assert _ids(outputs) == _ids(plain)
    assert _drafted(outputs).get("EAGLE3", 0) > 0  # untried: explored first
    spec.check_integrity()


def test_bad_auto_flags_fail_at_start_naming_the_flag(tiny_chat_model):
    cases = {
        "speculative_num_steps needs .*AUTO with --speculative-draft-model-path": dict(
            speculative_num_steps=2
        ),
        "speculative_eagle_topk needs .*AUTO with --speculative-draft-model-path": dict(
            speculative_eagle_topk=1
        ),
        "speculative_algorithm must be .*AUTO": dict(speculative_algorithm="AUTOMATIC"),
    }
    for message, flags in cases.items():
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**(AUTO | flags)).verify()
    # a draft path that is not an EAGLE-3 head (a whole model) fails loading, naming the flag
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        make_engine(tiny_chat_model, speculative_draft_model_path=tiny_chat_model, **AUTO)
