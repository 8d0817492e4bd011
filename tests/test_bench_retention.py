"""The agent-sessions workload and `radixserve bench retention`: pauses on the virtual clock,
and retention that keeps paused sessions' prefixes where plain LRU loses them."""

from __future__ import annotations

import json

import pytest

from radixserve.config import CacheConfig, SchedulerConfig
from radixserve_bench.cli import main as bench_main
from radixserve_bench.retention_bench import (
    VARIANTS,
    RetentionBenchArgs,
    compare,
    session_priority,
    sessions_pool_tokens,
)
from radixserve_bench.simulate import simulate
from radixserve_bench.workloads import BenchRequest, Workload, make_workload, parse_overrides

SESSIONS = (
    "num_sessions=4,num_turns=3,context_len=128,observation_len=16,output_len=8,"
    "pause_ms=20000,session_gap_ms=1000,num_flood=24,flood_len=96,flood_output_len=4"
)


@pytest.fixture(scope="module")
def sessions():
    from radixserve_bench.workloads import default_tokenizer

    return make_workload("agent-sessions", default_tokenizer(), overrides=parse_overrides(SESSIONS))


def test_workload_shape(sessions):
    reqs = sessions.requests
    turns = [r for r in reqs if r.session_id is not None]
    assert len(turns) == 4 * 3 and sum(r.session_id is None for r in reqs) == 24
    assert all(r.parent is None for r in turns if r.turn == 0)
    assert all(reqs[r.parent].session_id == r.session_id for r in turns if r.turn > 0)
    assert all(r.delay_s >= 0 for r in reqs)


def test_pauses_run_on_the_virtual_clock(sessions):
    result = simulate(sessions, SchedulerConfig(), CacheConfig(page_size=16, max_total_tokens=8192))
    for req, times in zip(sessions.requests, result.requests):
        if req.parent is not None:
            assert times.ready >= result.requests[req.parent].finished + req.delay_s - 1e-9


def test_retention_keeps_paused_sessions_that_lru_loses(sessions):
    bench = RetentionBenchArgs(
        cache_tokens=sessions_pool_tokens(sessions) * 3, max_pinned_fraction=0.9
    )
    rows = {row["run"]: row for row in compare(sessions, bench)}
    assert all(row["failed"] == 0 for row in rows.values())
    assert rows["lru"]["resumed_hit_rate"] < 0.5
    for run in ("tier", "retention hard", "retention last", "tier + retention"):
        assert rows[run]["resumed_hit_rate"] > rows["lru"]["resumed_hit_rate"] + 0.3, run
    assert rows["tier"]["host_cached_tokens"] > 0 and rows["lru"]["host_cached_tokens"] == 0
    assert rows["unbounded"]["resumed_hit_rate"] >= rows["retention hard"]["resumed_hit_rate"]


def _queue_waits(workload, result, resumed: bool) -> list[float]:
    """Sent -> admitted of resumed turns (or of one-off requests)."""
    waits = []
    for req, times in zip(workload.requests, result.requests):
        is_resumed = req.session_id is not None and req.turn > 0
        if is_resumed if resumed else req.session_id is None:
            waits.append(times.admitted - times.sent)
    return waits


def test_priority_puts_resumed_turns_first_and_the_flood_pays(sessions):
    cache = CacheConfig(page_size=16, max_total_tokens=sessions_pool_tokens(sessions))
    plain = simulate(sessions, SchedulerConfig(), cache)
    first = simulate(
        sessions,
        SchedulerConfig(enable_priority_scheduling=True),
        cache,
        priority_of=session_priority("resumed", 1),
    )
    resumed = [sum(_queue_waits(sessions, r, True)) for r in (plain, first)]
    assert resumed[1] < resumed[0] / 2  # resumed turns take the head of the queue
    assert sum(_queue_waits(sessions, first, False)) > sum(_queue_waits(sessions, plain, False))
    assert session_priority("session", 3)(sessions.requests[0]) == 3
    assert session_priority("resumed", 3)(sessions.requests[0]) == 0


@pytest.mark.parametrize("max_bypass", [3, 1000])
def test_aging_lets_a_one_off_request_through_a_stream_of_session_turns(max_bypass):
    """One running request at a time: a one-off request that came first waits behind at
    most `max_bypass` later session turns of higher priority (without aging: behind all)."""
    flood = BenchRequest(None, list(range(1, 33)), 2, conversation=99)
    turns = [BenchRequest(None, [s] * 32, 2, s, 0, f"agent-{s}") for s in range(1, 9)]
    workload = Workload("priority-stream", [flood, *turns])
    config = SchedulerConfig(
        enable_priority_scheduling=True, max_running_requests=1, schedule_max_bypass=max_bypass
    )
    cache = CacheConfig(page_size=16, max_total_tokens=1024)
    result = simulate(workload, config, cache, priority_of=session_priority("session", 1))
    admitted = sorted(range(len(workload.requests)), key=lambda i: result.requests[i].admitted)
    assert admitted.index(0) == min(max_bypass, len(turns))


def test_priorities_need_priority_scheduling_and_a_known_scope(sessions):
    cache = CacheConfig(page_size=16, max_total_tokens=8192)
    with pytest.raises(ValueError, match="enable_priority_scheduling"):
        simulate(sessions, SchedulerConfig(), cache, priority_of=session_priority("session", 1))
    with pytest.raises(ValueError, match="priority_scope"):
        session_priority("everyone", 1)


def test_bench_retention_cli_writes_its_report(tmp_path, capsys):
    out = tmp_path / "retention"
    args = ["retention", "--workload-args", SESSIONS, "--out", str(out)]
    assert bench_main(args) == 0
    assert "retention hard" in capsys.readouterr().out
    report = json.loads((out / "retention.json").read_text())
    assert [r["run"] for r in report["runs"]] == [
        "lru",
        "tier",
        "retention hard",
        "retention last",
        "tier + retention",
        "priority",
        "tier + priority",
        "tier + retention + priority",
        "unbounded",
    ]


LIVE = SESSIONS.replace("pause_ms=20000,session_gap_ms=1000", "pause_ms=400,session_gap_ms=50")


def test_live_run_on_a_real_engine_keeps_sessions_too(tiny_chat_model):
    from radixserve_bench.workloads import default_tokenizer

    workload = make_workload("agent-sessions", default_tokenizer(), overrides=parse_overrides(LIVE))
    bench = RetentionBenchArgs(
        cache_tokens=sessions_pool_tokens(workload) * 3,
        max_pinned_fraction=0.9,
        model=tiny_chat_model,
    )
    rows = {row["run"]: row for row in compare(workload, bench)}
    assert set(rows) == {v.name for v in VARIANTS if not v.unbounded}
    assert all(row["failed"] == 0 and row["num_resumed"] == 8 for row in rows.values())
    assert rows["retention hard"]["resumed_hit_rate"] > rows["lru"]["resumed_hit_rate"]
    assert rows["tier"]["resumed_hit_rate"] > rows["lru"]["resumed_hit_rate"]
    assert rows["tier"]["host_cached_tokens"] > 0


def test_the_bench_runs_every_variant_with_its_scheduler_flags(sessions):
    chunked = {r["run"]: r for r in compare(sessions, RetentionBenchArgs(chunked_prefill_size=32))}
    plain = {r["run"]: r for r in compare(sessions, RetentionBenchArgs())}
    assert chunked["lru"]["makespan_s"] > plain["lru"]["makespan_s"]  # more, smaller steps
