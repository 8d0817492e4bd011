"""KV events of a sliding-window model (cache/swa_radix_cache.py) through the ZMQ subscriber:
a tombstone inside the tree is silent (its pages still serve the hits that resume past it, as
in SGLang), a leaf whose every sliding page is tombstoned ends no hit and leaves the tree with
a BlockRemoved, so every path a router sees end is a full hit on the worker."""

from __future__ import annotations

import json

import pytest
from test_kv_events import Subscriber, replay, tree_prefixes

from conftest import VOCAB, free_port, greedy, make_engine, save_tiny_model
from radixserve.cache.kv_events import AllBlocksCleared, BlockRemoved

PAGE = 4
SYSTEM = [(i * 7 + 3) % 256 for i in range(48)]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    return str(save_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"), vocab_size=VOCAB))


@pytest.fixture
def subscriber():
    sub = Subscriber()
    yield sub
    sub.close()


def _path_ends(cached: dict[int, tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The prefixes no other stored prefix extends: where a router's longest match can end."""
    prefixes = set(cached.values())
    extended = {p[: len(p) - PAGE] for p in prefixes}
    return sorted(prefixes - extended)


def test_tombstoned_leaves_are_removed_and_every_stored_path_is_a_full_hit(gemma3, subscriber):
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = {"enable_kv_cache_events": True, "endpoint": subscriber.endpoint}
    config["replay_endpoint"] = replay_endpoint
    engine = make_engine(
        gemma3,
        page_size=PAGE,
        max_total_tokens=1024,
        swa_full_tokens_ratio=0.1,
        max_running_requests=3,
        kv_events_config=json.dumps(config),
    )
    try:
        subscriber.wait_connected()
        first = SYSTEM + [(j * 5 + 1) % 256 for j in range(9)]
        out = engine.generate(input_ids=first, sampling_params=greedy(8))["output_ids"]
        others = [SYSTEM + [(c * 31 + j) % 256 for j in range(12)] for c in range(8)]
        engine.generate(input_ids=others, sampling_params=greedy(8))
        assert engine.get_stats()["swa_tombstoned_pages"] > 0
        subscriber.receive_all(replay_endpoint)
        events = subscriber.events()
        cached = replay(events)
        assert cached == tree_prefixes(engine.cache)
        # the first conversation's window was tombstoned by the others: its pages were removed
        first_pages = tuple((first + out)[: len(first + out) // PAGE * PAGE])
        assert first_pages not in cached.values()
        assert any(isinstance(e, BlockRemoved) for e in events)
        for end in _path_ends(cached):  # a router's full match is the worker's usable one
            prompt = [*end, 1]  # a hit leaves one token to compute
            assert engine.cache.match_usable(prompt).num_tokens == len(end)
        engine.check_integrity()

        assert engine.flush_cache()
        subscriber.receive_until_quiet()
        assert subscriber.events()[-1] == AllBlocksCleared()
        assert replay(subscriber.events()) == {} == tree_prefixes(engine.cache)
    finally:
        engine.shutdown()
