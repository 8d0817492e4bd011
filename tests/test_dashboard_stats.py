"""`/dashboard/stats` against the engine's counters: on a server of this module's own (its
counters start at zero) after a known workload, its tree refreshing at most every two
seconds; and its speculative section, in process, mirroring the core's."""

from __future__ import annotations

import json
import time

import pytest
from dashboard_http import GREEDY, http, stats_of

from conftest import ServerProcess, prompt_ids
from radixserve.config import ServerConfig
from radixserve.server.app import build_app
from radixserve.server.dashboard_stats import TREE_REFRESH_S


@pytest.fixture(scope="module")
def fresh_server(tiny_chat_model):
    """A server of this module's own, so that its counters start at zero."""
    proc = ServerProcess(tiny_chat_model)
    yield proc
    proc.stop()


def test_stats_match_engine_counters_after_a_known_workload(fresh_server):
    url = fresh_server.url
    first = stats_of(url)
    assert first["throughput"] is None and first["cache"]["hit_rate_last_minute"] is None
    prefix = prompt_ids(7, 48)  # three pages of 16
    for suffix in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        body = {"input_ids": prefix + suffix, "sampling_params": GREEDY}
        assert http(url + "/generate", body)[0] == 200
    time.sleep(TREE_REFRESH_S)  # the first call's (empty) tree is kept this long
    board = stats_of(url)
    status, _, info = http(url + "/server_info")
    engine = json.loads(info)["stats"]

    cache = board["cache"]
    assert (cache["prompt_tokens"], cache["cached_tokens"]) == (3 * 51, 2 * 48)
    assert cache["prompt_tokens"] == engine["prompt_tokens"]
    assert cache["cached_tokens"] == engine["cached_tokens"]
    assert cache["prefill_tokens_computed"] == engine["prefill_tokens_computed"] == 51 + 2 * 3
    assert cache["hit_rate_since_start"] == pytest.approx(96 / 153)
    assert cache["hit_rate_last_minute"] == pytest.approx(96 / 153)
    throughput = board["throughput"]
    assert throughput["input_tokens_per_s"] * throughput["window_s"] == pytest.approx(153)
    assert throughput["output_tokens_per_s"] * throughput["window_s"] == pytest.approx(
        engine["decode_tokens"]
    )
    assert board["requests"] == {"running": 0, "waiting": 0, "total": 3}
    kv = board["kv_pages"]
    parts = ("free", "tree_evictable", "tree_locked", "tree_pinned", "held")
    assert sum(kv[p] for p in parts) == kv["capacity"]
    assert (kv["free"], kv["held"], kv["tree_locked"]) == (engine["pool_free_pages"], 0, 0)
    assert kv["tree_pinned"] == engine["tree_pinned_pages"] == 0
    assert kv["tree_evictable"] == engine["tree_pages"] == 3
    latency = board["latency"]
    assert latency["window_s"] == 60
    for name in ("ttft", "e2e"):
        assert latency[name]["count"] == 3 and 0 < latency[name]["p50"] <= latency[name]["p99"]
    assert 0 < latency["itl"]["count"] <= 3 * 3  # tokens arriving together count once each
    assert board["pressure"]["retractions"] == engine["retractions"] == 0
    assert board["speculative"] is None
    (node,) = board["tree"]["children"]
    assert (node["subtree_tokens"], node["hits"], node["first_ids"]) == (48, 2, prefix[:8])
    assert isinstance(node["label"], str) and node["label"]


def test_stats_tree_refreshes_at_most_every_two_seconds(fresh_server):
    url = fresh_server.url
    before = stats_of(url)["tree"]
    body = {"input_ids": prompt_ids(8, 40), "sampling_params": GREEDY}
    assert http(url + "/generate", body)[0] == 200
    time.sleep(TREE_REFRESH_S)
    assert len(stats_of(url)["tree"]["children"]) == len(before["children"]) + 1


def test_stats_show_speculative_counters_when_it_is_on(tiny_chat_model):
    """In process (TestClient over an Engine): the speculative section mirrors the core."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from conftest import make_engine
    from radixserve.server.metrics import ServerMetrics
    from radixserve.server.state import ServerState

    engine = make_engine(tiny_chat_model, speculative_algorithm="NGRAM")
    state = ServerState(
        client=engine.client,
        builder=engine.builder,
        tokenizer=engine.tokenizer,
        config=ServerConfig(),
        engine_args={"speculative_algorithm": "NGRAM"},
        model_path=tiny_chat_model,
        served_model_name="tiny",
        max_running_requests=256,
        metrics=ServerMetrics(),
    )
    repeating = {"input_ids": [5, 6, 7, 8] * 12, "sampling_params": GREEDY | {"max_new_tokens": 24}}

    async def run():
        async with TestClient(TestServer(build_app(state))) as client:
            assert (await client.post("/generate", json=repeating)).status == 200
            return await (await client.get("/dashboard/stats")).json()

    try:
        board = asyncio.run(run())
        engine_stats = engine.get_stats()
    finally:
        engine.shutdown()
    spec = board["speculative"]
    assert spec["draft_tokens"] == engine_stats["spec_draft_tokens"]
    assert spec["accepted_tokens"] == engine_stats["spec_accepted_tokens"]
    assert spec["accept_length"] == pytest.approx(engine_stats["spec_accept_length"])
    assert spec["draft_tokens"] > 0  # the repeating prompt gives the n-gram drafter matches
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
    assert board["model"] == "tiny" and board["requests"]["total"] == 1
