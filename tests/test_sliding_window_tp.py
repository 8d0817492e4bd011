"""Sliding-window memory under tensor parallelism (gloo, two ranks): rank 0's scheduler owns
the sliding-page table and every batch carries the entries it rewrote, so the second rank
reads and writes its shard of the sliding layers' heads in the same pages. Agent turns
that tombstone windows and recompute them give the tokens of one process."""

from __future__ import annotations

import pytest

from conftest import VOCAB, greedy, make_engine, save_tiny_model
from radixserve.cache.swa_pool import HybridKVPool

PAGE = 4
SYSTEM = [(i * 7 + 3) % 256 for i in range(48)]
FLAGS = dict(
    page_size=PAGE, max_total_tokens=1024, swa_full_tokens_ratio=0.1, max_running_requests=3
)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    return str(save_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"), vocab_size=VOCAB))


def _agent_turns(engine) -> tuple[list[list[int]], list[int]]:
    """A first conversation, eight others over the same system prompt that tombstone its
    window, then its next turn and the others' next turns."""
    run = lambda prompts, n: engine.generate(input_ids=prompts, sampling_params=greedy(n))  # noqa: E731
    first = [SYSTEM + [(j * 5 + 1) % 256 for j in range(9)]]
    out = [o["output_ids"] for o in run(first, 8)]
    others = [SYSTEM + [(c * 31 + j) % 256 for j in range(12)] for c in range(8)]
    others_out = [o["output_ids"] for o in run(others, 8)]
    follow_up = [first[0] + out[0] + [9, 8, 7, 6, 5]]
    turns = [o + t + [3] * 5 for o, t in zip(others, others_out)]
    results = run(follow_up + turns, 10)
    tokens = [out[0], *others_out, *(o["output_ids"] for o in results)]
    return tokens, [o["meta_info"]["cached_tokens"] for o in results]


def test_tp2_keeps_two_page_spaces_and_matches_one_process(gemma3):
    one = make_engine(gemma3, **FLAGS)
    try:
        want, want_cached = _agent_turns(one)
    finally:
        one.shutdown()
    engine = make_engine(gemma3, tp_size=2, device="cpu", **FLAGS)
    try:
        assert isinstance(engine.runner.pool, HybridKVPool)
        got, cached = _agent_turns(engine)
        stats = engine.get_stats()
        assert stats["swa_tombstoned_pages"] > 0 and min(cached) >= len(SYSTEM)
        assert got == want and cached == want_cached
        engine.check_integrity()
    finally:
        engine.shutdown()
