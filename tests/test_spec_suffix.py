"""SUFFIX speculative decoding: the suffix-tree rule on small arrays, the bounded per-namespace
store of outputs, and end to end on the random `tiny_chat_model` (whose greedy output rarely
repeats itself, so a warm run's accepted drafts come from the store of earlier outputs)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import greedy, make_engine, prompt_ids
from radixserve.config import SchedulerConfig
from radixserve.engine.speculative import SuffixDrafter, suffix_match
from radixserve.engine.speculative.suffix import SuffixStore
from radixserve.engine.speculative.suffix_match import SuffixLimits, speculate

# speculative_adaptive_threshold 0: never back off. What drafts and what they accept is what
# these tests compare, not the verify's cost, which the engine learns from step times once a
# step takes over 2 ms (a tiny model's does on a loaded or AVX2-only machine; then SUFFIX
# backs off and the warm accept lengths read ~1, as test_spec_auto's NEVER_BACK_OFF says).
SUFFIX = {
    "speculative_algorithm": "SUFFIX",
    "speculative_num_draft_tokens": 6,
    "speculative_adaptive_threshold": 0.0,
}


def _limits(depth=24, factor=1.0, min_prob=0.1, num=8) -> SuffixLimits:
    return SuffixLimits(depth, factor, min_prob, num)


def _arr(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def _ids(outputs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def _spec_stats(engine) -> dict:
    return {k: v for k, v in engine.get_stats().items() if k.startswith("spec_")}


# ---- the rule ------------------------------------------------------------------------------


def test_draft_length_follows_the_match_length_and_factor():
    seq = _arr([1, 2, 3, 4, 5, 6, 7, 8, 9, -1])
    # "3" matches 1 token: factor 1 drafts 1; "2 3" matches 2: drafts 2
    assert speculate(seq, len(seq), _arr([9, 3]), _limits()).tokens == [4]
    draft = speculate(seq, len(seq), _arr([1, 2, 3]), _limits())
    assert draft.tokens == [4, 5] and draft.match_len == 2 and draft.probs == [1.0, 1.0]
    assert speculate(seq, len(seq), _arr([1, 2, 3]), _limits(factor=2.0)).tokens == [4, 5, 6, 7]
    # the cap K and the tree depth (match + draft <= depth) bound it too; a separator ends it
    assert speculate(seq, len(seq), _arr([1, 2, 3]), _limits(factor=9, num=3)).tokens == [4, 5, 6]
    assert speculate(seq, len(seq), _arr([1, 2, 3]), _limits(depth=3, factor=9)).tokens == [4, 5]
    assert speculate(seq, len(seq), _arr([6, 7, 8]), _limits(factor=9)).tokens == [9]


def test_frequencies_choose_the_path_and_min_token_prob_stops_it():
    # after "5": 6 twice, 7 once; after "5 6": 8 then 9 or 8 then 10
    seq = _arr([5, 6, 8, 9, -1, 5, 6, 8, 10, -1, 5, 7, -1])
    draft = speculate(seq, len(seq), _arr([0, 5]), _limits(factor=9))
    assert draft.tokens == [6, 8, 9] and np.allclose(draft.probs, [2 / 3, 2 / 3, 1 / 3])
    assert speculate(seq, len(seq), _arr([0, 5]), _limits(factor=9, min_prob=0.5)).tokens == [6, 8]
    assert speculate(seq, len(seq), _arr([0, 5]), _limits(factor=9, min_prob=0.7)).tokens == []


def test_the_best_scoring_match_wins_and_own_positions_exclude_the_context():
    # "3" alone is followed by 4 and by 9 (a tie: the smaller id); "2 3" only by 9
    seq = _arr([3, 4, -1, 2, 3, 9, 9, -1])
    tie = speculate(seq, len(seq), _arr([0, 3]), _limits())
    assert tie.tokens == [4] and tie.probs == [0.5]
    draft = speculate(seq, len(seq), _arr([1, 2, 3]), _limits())
    assert draft.tokens == [9, 9] and draft.match_len == 2 and draft.score == 2.0
    own = _arr([7, 8, 1, 7, 8])  # a request's sequence: its last position is the context's
    assert speculate(own, len(own) - 1, own, _limits()).tokens == [1, 7]
    counted = speculate(own, len(own), own, _limits())  # the end would halve each estimate
    assert counted.tokens == [1, 7] and counted.probs == [0.5, 0.5]


def test_a_lookup_counts_the_latest_occurrences_only(monkeypatch):
    seq = _arr([5, 1, -1, 5, 1, -1, 5, 2, -1, 5, 2, -1])
    everything = speculate(seq, len(seq), _arr([0, 5]), _limits())
    assert everything.tokens == [1] and everything.probs == [0.5]  # a tie: the smaller id
    monkeypatch.setattr(suffix_match, "MAX_OCCURRENCES", 2)
    latest = speculate(seq, len(seq), _arr([0, 5]), _limits())
    assert latest.tokens == [2] and latest.probs == [1.0]


# ---- the store -----------------------------------------------------------------------------


def test_the_most_frequent_continuation_on_every_counting_path():
    """Small sets (plain Python), a strict majority (checked in O(n)), unique and bincount
    sets: the most frequent token and its count, ties to the smallest id."""
    rng = np.random.default_rng(0)
    for size in (1, 5, 32, 33, 100, 255, 256, 1024):
        for spread in (1, 3, 40, 5000):
            values = rng.integers(0, spread, size)
            if spread == 40 and size > 2:  # mostly one token, as repeated outputs continue
                values[: int(size * 0.9)] = 7
                rng.shuffle(values)
            counts = np.bincount(values)
            want = (int(counts.argmax()), int(counts.max()))  # argmax: the smallest on a tie
            assert suffix_match._most_frequent(values) == want, (size, spread)
    tie = _arr([5, 3] * 40)  # no majority: the smaller id
    assert suffix_match._most_frequent(tie) == (3, 40)


def test_store_is_bounded_lru_per_namespace():
    store = SuffixStore(max_requests=3, max_tokens=100)
    for base in (100, 200, 300):
        store.add("a", [base + i for i in range(6)])
    limits = _limits()
    assert store.speculate("b", _arr([100, 101, 102]), limits).tokens == []  # another tenant
    used = store.speculate("a", _arr([100, 101, 102]), limits)
    assert used.tokens == [103, 104]
    store.mark_used("a", used)  # 100.. is now the most recently used; 200.. the oldest
    store.add("b", [900, 901, 902])
    assert len(store) == 3
    assert store.speculate("a", _arr([200, 201, 202]), limits).tokens == []
    assert store.speculate("a", _arr([100, 101, 102]), limits).tokens == [103, 104]
    assert store.speculate("b", _arr([900, 901]), limits).tokens == [902]
    store.add("c", list(range(1000, 1250)))  # longer than the token bound: its end only
    assert store.num_tokens <= 100 and len(store) == 1
    assert store.speculate("a", _arr([100, 101, 102]), limits).tokens == []
    assert store.speculate("c", _arr([1247, 1248]), limits).tokens == [1249]
    none = SuffixStore(max_requests=0, max_tokens=100)
    none.add("a", [1, 2, 3])
    assert len(none) == 0


# ---- end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected(tiny_chat_model) -> dict:
    """Plain greedy outputs of the prompts the end-to-end tests use."""
    plain = make_engine(tiny_chat_model)
    prompts = [prompt_ids(i, 20 + 23 * i) for i in range(4)]
    return {
        "prompts": prompts,
        "outputs": _ids(plain.generate(input_ids=prompts, sampling_params=greedy(40))),
    }


def test_greedy_matches_plain_decoding_cold_and_warm(tiny_chat_model, expected):
    spec = make_engine(tiny_chat_model, page_size=1, chunked_prefill_size=32, **SUFFIX)
    assert isinstance(spec.scheduler.drafter, SuffixDrafter)
    initial_free = spec.runner.pool.allocator.num_free
    prompts = expected["prompts"]
    cold = spec.generate(input_ids=prompts, sampling_params=greedy(40))
    cold_accepted = _spec_stats(spec)["spec_accepted_tokens"]
    warm = spec.generate(input_ids=prompts, sampling_params=greedy(40))
    assert _ids(cold) == _ids(warm) == expected["outputs"]
    warm_meta = [o["meta_info"] for o in warm]
    assert sum(m["spec_accept_token_num"] for m in warm_meta) > cold_accepted
    assert all(m["spec_accept_length"] > 1.5 for m in warm_meta)  # drafted from the store
    spec.check_integrity()
    assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free


def test_a_suffix_learnt_under_one_salt_is_not_used_under_another(tiny_chat_model, expected):
    spec = make_engine(tiny_chat_model, **SUFFIX)
    prompt, params = expected["prompts"][1], greedy(40)

    def accepted(salt: str) -> int:
        out = spec.generate(input_ids=prompt, sampling_params=params, cache_salt=salt)
        assert out["output_ids"] == expected["outputs"][1]
        return out["meta_info"]["spec_accept_token_num"]

    cold = accepted("tenant-a")
    assert accepted("tenant-b") == cold  # b's store is empty: its own sequence only
    assert accepted("tenant-a") > cold  # a's second run drafts from a's first output
    drafter = spec.scheduler.drafter
    context = np.asarray(expected["outputs"][1][:8], dtype=np.int64)
    assert drafter.store.speculate("tenant-c", context, drafter.limits).tokens == []


def test_tiny_pool_retracts_speculating_requests_and_still_matches(tiny_chat_model):
    prompts = [prompt_ids(i, 24) for i in range(8)]
    want = _ids(
        make_engine(tiny_chat_model).generate(input_ids=prompts, sampling_params=greedy(50))
    )
    small = make_engine(
        tiny_chat_model,
        max_total_tokens=384,
        chunked_prefill_size=64,
        schedule_conservativeness=0.1,
        **SUFFIX,
    )
    initial_free = small.runner.pool.allocator.num_free
    for _ in range(2):  # the second round drafts from the first's outputs
        assert _ids(small.generate(input_ids=prompts, sampling_params=greedy(50))) == want
    assert small.get_stats()["retractions"] > 0
    assert _spec_stats(small)["spec_accepted_tokens"] > 0
    small.check_integrity()
    assert small.flush_cache() and small.runner.pool.allocator.num_free == initial_free


def test_stops_and_seeded_sampling_through_the_shared_verify_path(tiny_chat_model, expected):
    spec = make_engine(tiny_chat_model, **SUFFIX)
    prompt, reference = expected["prompts"][2], expected["outputs"][2]
    stop = spec.tokenizer.decode(reference[25:27])
    plain_out = make_engine(tiny_chat_model).generate(
        input_ids=prompt, sampling_params=greedy(40, stop=[stop])
    )
    for _ in range(2):  # cold, then drafted from the store
        out = spec.generate(input_ids=prompt, sampling_params=greedy(40, stop=[stop]))
        assert out["output_ids"] == plain_out["output_ids"] and out["text"] == plain_out["text"]
    # sampled (close to greedy, so drafts from the greedy outputs stored above pay): drafts
    # go through the rejection rule
    params = {"temperature": 0.1, "max_new_tokens": 30, "sampling_seed": 3}
    runs = [spec.generate(input_ids=prompt, sampling_params=params) for _ in range(2)]
    assert all(len(r["output_ids"]) == 30 for r in runs)
    assert all(r["meta_info"]["spec_accept_token_num"] > 0 for r in runs)
    spec.check_integrity()


def test_bad_suffix_flags_fail_naming_the_flag(tiny_chat_model):
    cases = {
        "speculative_suffix_max_tree_depth must be >= 2": dict(speculative_suffix_max_tree_depth=1),
        "speculative_suffix_max_spec_factor must be > 0": dict(
            speculative_suffix_max_spec_factor=0.0
        ),
        "speculative_suffix_min_token_prob must be in": dict(speculative_suffix_min_token_prob=1.5),
        "speculative_suffix_max_cached_requests must be >= 0": dict(
            speculative_suffix_max_cached_requests=-1
        ),
        "speculative_suffix_max_cached_tokens must be >= 1": dict(
            speculative_suffix_max_cached_tokens=0
        ),
    }
    for message, flags in cases.items():
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**(SUFFIX | flags)).verify()
    with pytest.raises(ValueError, match="speculative_suffix_min_token_prob"):
        make_engine(tiny_chat_model, speculative_suffix_min_token_prob=-0.1, **SUFFIX)
