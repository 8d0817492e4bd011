"""Sliding-window memory (cache/swa_pool.py, cache/swa_radix_cache.py) through the Engine: a
running request holds at most window / page_size + 1 sliding pages of its own, the tree
keeps sliding K/V only for the windows hits resume from, tombstoned windows are recomputed
with output equal to a cold run, a tiny sliding space retracts and recovers, and bad
--swa-full-tokens-ratio values are refused naming the flag."""

from __future__ import annotations

import pytest

from conftest import VOCAB, greedy, make_engine, save_tiny_model

PAGE = 4
WINDOWS = {"gemma3": 12, "mistral": 24}  # conftest's tiny configs
SYSTEM = [(i * 7 + 3) % 256 for i in range(48)]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: str(save_tiny_model(arch, root / arch, vocab_size=VOCAB)) for arch in WINDOWS}


@pytest.fixture(scope="module")
def one_pool(tiny_models):
    """gemma3 with every layer's K/V in one pool (the memory layout before this change):
    the reference for outputs."""
    return make_engine(tiny_models["gemma3"], page_size=PAGE, disable_hybrid_swa_memory=True)


def _outputs(engine, prompts, num_tokens):
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(num_tokens))
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


@pytest.mark.parametrize("arch", list(WINDOWS))
def test_a_running_request_holds_one_window_of_sliding_pages(tiny_models, arch):
    """A long generation: the request's own sliding pages stay within window / page + 1,
    the decoded pages keep sliding K/V for their last window only, and the tokens equal
    those of the one-pool layout."""
    window = WINDOWS[arch]
    prompts = [[(i * 37 + 5 * k) % 256 for i in range(41 + k)] for k in range(2)]
    engine = make_engine(tiny_models[arch], page_size=PAGE)
    reference = make_engine(tiny_models[arch], page_size=PAGE, disable_hybrid_swa_memory=True)
    tokens, _ = _outputs(engine, prompts, 80)
    assert tokens == _outputs(reference, prompts, 80)[0]
    stats = engine.get_stats()
    assert window // PAGE <= stats["max_req_sliding_pages"] <= window // PAGE + 1
    assert stats["tree_pages"] >= 2 * 120 // PAGE
    # the prompts' pages entered the tree after their prefill, every sliding page live; of
    # the decoded ones, only each sequence's last window kept its sliding K/V
    assert stats["swa_tree_live_pages"] <= 2 * (41 // PAGE + window // PAGE + 1)
    assert reference.get_stats()["max_req_sliding_pages"] == 0  # no second space there
    engine.check_integrity()
    assert engine.flush_cache()
    stats = engine.get_stats()
    assert stats["swa_pool_free_pages"] == stats["swa_pool_capacity_pages"]


def test_agent_turns_tombstone_and_recompute_windows(tiny_models, one_pool):
    """Conversations over a long shared system prompt with a sliding space of 25 pages
    (three running at a time): later turns hit the cache; the first conversation's window
    is tombstoned by the others, so its next turn resumes after the system prompt and
    recomputes the rest, with the tokens of the one-pool layout."""
    engine = make_engine(
        tiny_models["gemma3"],
        page_size=PAGE,
        max_total_tokens=1024,
        swa_full_tokens_ratio=0.1,
        max_running_requests=3,
    )
    first = [SYSTEM + [(j * 5 + 1) % 256 for j in range(9)]]
    out, _ = _outputs(engine, first, 8)
    others = [SYSTEM + [(c * 31 + j) % 256 for j in range(12)] for c in range(8)]
    others_out, others_cached = _outputs(engine, others, 8)
    assert min(others_cached) >= len(SYSTEM)
    assert engine.get_stats()["swa_tombstoned_pages"] > 0
    follow_up = [first[0] + out[0] + [9, 8, 7, 6, 5]]
    again, cached = _outputs(engine, follow_up, 10)
    full_hit = (len(first[0]) + len(out[0])) // PAGE * PAGE
    assert len(SYSTEM) <= cached[0] < full_hit  # the conversation's window was tombstoned
    turns = [o + t + [3] * 5 for o, t in zip(others, others_out)]
    later, later_cached = _outputs(engine, turns, 10)
    assert min(later_cached) >= len(SYSTEM)
    assert again == _outputs(one_pool, follow_up, 10)[0]
    assert later == _outputs(one_pool, turns, 10)[0]
    engine.check_integrity()


def test_a_tiny_pool_retracts_and_recovers_both_spaces(tiny_models, one_pool):
    """32 pages and 25 sliding pages for eight requests: retractions (their sequences go to
    the tree with tombstones and resume from their last live window), the one-pool tokens,
    and both page spaces back to free after a flush."""
    prompts = [[(i * 37 + 5 * k) % 256 for i in range(14 + 3 * k)] for k in range(8)]
    engine = make_engine(
        tiny_models["gemma3"],
        page_size=PAGE,
        max_total_tokens=128,
        chunked_prefill_size=8,
    )
    tokens, _ = _outputs(engine, prompts, 48)
    assert tokens == _outputs(one_pool, prompts, 48)[0]
    stats = engine.get_stats()
    assert stats["retractions"] > 0 and stats["swa_pool_capacity_pages"] == 25
    engine.check_integrity()
    assert engine.flush_cache()
    stats = engine.get_stats()
    allocator = engine.runner.pool.allocator
    assert allocator.num_free_global == allocator.capacity_global == 32
    assert stats["pool_free_pages"] == stats["pool_capacity_pages"] == 25  # with sliding pages
    assert stats["swa_pool_free_pages"] == stats["swa_pool_capacity_pages"]


def test_prefill_chunks_fit_a_small_sliding_space(tiny_models, one_pool):
    """12 sliding pages and a 100-token prompt under the default 2048-token chunks: the
    chunks shrink to what the sliding space can hold beside a window, instead of waiting
    forever for pages."""
    engine = make_engine(
        tiny_models["gemma3"], page_size=PAGE, max_total_tokens=512, swa_full_tokens_ratio=0.1
    )
    prompt = [[(i * 13 + 7) % 256 for i in range(100)]]
    assert engine.get_stats()["swa_pool_capacity_pages"] == 12
    assert _outputs(engine, prompt, 8)[0] == _outputs(one_pool, prompt, 8)[0]
    engine.check_integrity()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"swa_full_tokens_ratio": 0.0}, "--swa-full-tokens-ratio must be in"),
        ({"swa_full_tokens_ratio": 1.5}, "--swa-full-tokens-ratio must be in"),
        ({"swa_full_tokens_ratio": 0.01, "max_total_tokens": 256}, "--swa-full-tokens-ratio"),
        ({"enable_hierarchical_cache": True}, "--disable-hybrid-swa-memory"),
    ],
)
def test_bad_sliding_space_flags_are_refused(tiny_models, flags, message):
    with pytest.raises(ValueError, match=message):
        make_engine(tiny_models["gemma3"], page_size=PAGE, **flags)
