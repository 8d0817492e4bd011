"""`radixserve bench retention`: the agent-sessions workload through the real scheduler and
radix cache (the simulator's virtual clock and cost model), with plain LRU, with the
hierarchical cache's host tier, with session retention (pin_policy hard and last), with
session requests at a higher `priority` than the flood (--enable-priority-scheduling), with
their combinations, and with an unbounded cache (the hit-rate ceiling).

Resumed turns (a session's turns after the first) are what retention is for: their hit rate
and TTFT are the headline numbers; the one-off flood's TTFT shows what retention costs it.
A table on stdout, every number in `<out>/retention.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.cli_args import add_dataclass_args
from radixserve.config import CacheConfig, HiCacheConfig, SchedulerConfig
from radixserve_bench.common import from_args, load_tokenizer, write_json
from radixserve_bench.metrics import latency_stats
from radixserve_bench.sessions_live import LiveRun
from radixserve_bench.sim_runner import CostModel
from radixserve_bench.simulate import RequestTimes, SimResult, simulate
from radixserve_bench.workloads import BenchRequest, Workload, make_workload, parse_overrides

SESSIONS_IN_POOL = 1 / 3  # the sizing: the pool holds about a third of the sessions
PRIORITY_SCOPES = ("session", "resumed")


@dataclass
class RetentionBenchArgs:
    """Workload size, pool, and retention settings."""

    preset: str = "default"
    """default | small (agent-sessions presets)."""
    workload_args: str | None = None
    """Overrides of the agent-sessions workload, e.g. num_sessions=24,pause_ms=30000."""
    seed: int = 0
    """Seed of the workload's text, pauses and flood arrivals."""
    cache_tokens: int = 0
    """KV pool in tokens (0: a third of the sessions' final size, as the issue asks)."""
    retention_ttl_s: float = 120.0
    """TTL each session turn asks for."""
    max_pinned_fraction: float = 0.3
    """The retention run's bound on pinned pages (--max-pinned-fraction)."""
    page_size: int = 16
    """Tokens per KV page."""
    hicache_ratio: float = 2.0
    """The tier runs' host tier, as a multiple of the pool (--hicache-ratio)."""
    hicache_write_policy: str = "write_through"
    """The tier runs' --hicache-write-policy."""
    session_priority: int = 1
    """The priority runs' `priority` of session requests (one-off requests: 0), with
    --enable-priority-scheduling."""
    priority_scope: str = "session"
    """session | resumed: which session requests the priority runs mark (every turn, or the
    turns after the first)."""
    schedule_policy: str = "lpm"
    """--schedule-policy of every run."""
    chunked_prefill_size: int = 2048
    """--chunked-prefill-size of every run: most prefill tokens one step computes (a short
    resumed turn batched with a long cold prefill waits for all of it)."""
    schedule_tier_match_weight: float = 0.0
    """--schedule-tier-match-weight of every run (what a tier-only cached token counts for in
    lpm, relative to a pool one)."""
    model: str | None = None
    """Run on a real Engine with this model, in real time (pauses are slept), instead of the
    simulator ("default": the default model); the unbounded run is skipped."""
    out: str = "bench_results/retention"
    """Folder for retention.json."""
    log_level: str = "warning"
    """debug | info | warning | error."""


def add_retention_parser(modes) -> None:
    parser = modes.add_parser(
        "retention",
        help="agent sessions with pauses: plain LRU vs host tier vs retention vs unbounded",
    )
    add_dataclass_args(parser, RetentionBenchArgs, "retention benchmark")


def run_retention_bench(args: argparse.Namespace) -> int:
    """Entry point of `radixserve bench retention`."""
    bench = from_args(RetentionBenchArgs, args)
    overrides = parse_overrides(bench.workload_args)
    workload = make_workload("agent-sessions", load_tokenizer(None), bench.seed, bench.preset,
                             overrides)  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = compare(workload, bench)
    finally:
        torch.set_num_threads(threads)
    print(format_rows(rows, f"agent-sessions ({bench.preset}), {len(workload.requests)} requests"))
    config = {"workload_config": workload.config, "bench": dataclasses.asdict(bench)}
    print(f"wrote {write_json(Path(bench.out) / 'retention.json', rows, config)}")
    return 0


@dataclass(frozen=True)
class Variant:
    """One run of the comparison: which of retention, the tier and priorities it uses."""

    name: str
    retention: bool = False
    pin_policy: str = "hard"
    tier: bool = False
    priority: bool = False
    unbounded: bool = False


VARIANTS = [
    Variant("lru"),
    Variant("tier", tier=True),
    Variant("retention hard", retention=True),
    Variant("retention last", retention=True, pin_policy="last"),
    Variant("tier + retention", retention=True, tier=True),
    Variant("priority", priority=True),
    Variant("tier + priority", tier=True, priority=True),
    Variant("tier + retention + priority", retention=True, tier=True, priority=True),
    Variant("unbounded", unbounded=True),
]


def session_priority(scope: str, value: int) -> Callable[[BenchRequest], int]:
    """The priority an agent gives its requests: `value` for every turn of a session
    ("session") or for its resumed turns only ("resumed"); one-off requests get 0."""
    if scope not in PRIORITY_SCOPES:
        raise ValueError(f"priority_scope must be one of {PRIORITY_SCOPES}; got {scope!r}")

    def priority_of(req: BenchRequest) -> int:
        if req.session_id is None or (scope == "resumed" and req.turn == 0):
            return 0
        return value

    return priority_of


def compare(workload: Workload, bench: RetentionBenchArgs) -> list[dict[str, Any]]:
    """One summary per variant (all lpm, same workload)."""
    pool = bench.cache_tokens or sessions_pool_tokens(workload)
    unbounded = sum(len(p) for p in workload.prompts()) + pool
    priority_of = session_priority(bench.priority_scope, bench.session_priority)
    tier = HiCacheConfig(
        enable_hierarchical_cache=True,
        hicache_ratio=bench.hicache_ratio,
        hicache_write_policy=bench.hicache_write_policy,
    )
    # an unbounded pool of real KV is too large to allocate
    variants = [v for v in VARIANTS if bench.model is None or not v.unbounded]
    rows = []
    for variant in variants:
        tokens = unbounded if variant.unbounded else pool
        scheduler = SchedulerConfig(
            max_pinned_fraction=bench.max_pinned_fraction,
            pin_policy=variant.pin_policy,
            enable_priority_scheduling=variant.priority,
            schedule_policy=bench.schedule_policy,
            chunked_prefill_size=bench.chunked_prefill_size,
            schedule_tier_match_weight=bench.schedule_tier_match_weight,
        )
        cache = CacheConfig(page_size=bench.page_size, max_total_tokens=tokens)
        ttl = bench.retention_ttl_s if variant.retention else None
        hicache = tier if variant.tier else None
        priorities = priority_of if variant.priority else None
        start = time.perf_counter()
        if bench.model is None:
            cost = CostModel()
            result = simulate(workload, scheduler, cache, cost, None, ttl, hicache, priorities)
        else:
            result = run_live(bench.model, workload, scheduler, cache, ttl, hicache, priorities)
        rows.append({"run": variant.name, "cache_tokens": tokens} | summarize(workload, result))
        print(f"{variant.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return rows


def run_live(
    model: str,
    workload: Workload,
    scheduler: SchedulerConfig,
    cache: CacheConfig,
    ttl: float | None,
    hicache: HiCacheConfig | None = None,
    priority_of: Callable[[BenchRequest], int] | None = None,
) -> SimResult:
    """One run on a fresh Engine (an empty cache), in real time."""
    from radixserve import Engine

    kwargs = dataclasses.asdict(scheduler) | dataclasses.asdict(cache)
    kwargs |= dataclasses.asdict(hicache or HiCacheConfig())
    with Engine(None if model == "default" else model, **kwargs) as engine:
        result = LiveRun(engine, workload, ttl, priority_of).run()
        result.stats = engine.get_stats()
    return result


def sessions_pool_tokens(workload: Workload) -> int:
    """A pool of about a third of the sessions' final sizes (last turn's prompt + output)."""
    prompts = workload.prompts()
    last: dict[str, int] = {}
    for req, prompt in zip(workload.requests, prompts):
        if req.session_id is not None:
            last[req.session_id] = len(prompt) + req.output_len
    return int(sum(last.values()) * SESSIONS_IN_POOL)


def summarize(workload: Workload, result: SimResult) -> dict[str, Any]:
    """Hit rates and TTFTs of resumed turns, and the flood's TTFT."""
    resumed, flood, failed = [], [], 0
    for req, times in zip(workload.requests, result.requests):
        if times.error:
            failed += 1
        elif req.session_id is not None and req.turn > 0:
            resumed.append(times)
        elif req.session_id is None:
            flood.append(times)
    cached = sum(t.cached_tokens for t in resumed)
    prompt = sum(t.prompt_len for t in resumed)
    return {
        "num_resumed": len(resumed),
        "failed": failed,
        "resumed_hit_rate": cached / prompt if prompt else 0.0,
        **latency_stats("resumed_ttft", [t.first_token - t.sent for t in resumed]),
        **latency_stats("flood_ttft", [t.first_token - t.sent for t in flood]),
        # queueing alone (sent -> admitted, simulator only): what admission order decides
        **latency_stats("resumed_queue", _queue_waits(resumed)),
        **latency_stats("flood_queue", _queue_waits(flood)),
        "makespan_s": result.makespan,
        "evicted_pages": result.stats.get("evicted_pages", 0),
        "host_cached_tokens": sum(t.cached_tokens_host for t in resumed),
    }


def _queue_waits(times: list[RequestTimes]) -> list[float]:
    """Seconds from sent to admitted; a live run does not see admission (empty)."""
    return [t.admitted - t.sent for t in times if t.admitted is not None]


COLUMNS = [
    ("run", "run", "{}"),
    ("pool tok", "cache_tokens", "{}"),
    ("resumed hit", "resumed_hit_rate", "{:.3f}"),
    ("resumed TTFT p50 s", "median_resumed_ttft_ms", "{:.2f}"),
    ("resumed TTFT p99 s", "p99_resumed_ttft_ms", "{:.2f}"),
    ("flood TTFT p99 s", "p99_flood_ttft_ms", "{:.2f}"),
    ("resumed queue mean s", "mean_resumed_queue_ms", "{:.2f}"),
    ("flood queue p99 s", "p99_flood_queue_ms", "{:.2f}"),
    ("makespan s", "makespan_s", "{:.0f}"),
    ("evicted pages", "evicted_pages", "{}"),
    ("resumed from tier", "host_cached_tokens", "{}"),
    ("failed", "failed", "{}"),
]


def format_rows(rows: list[dict[str, Any]], title: str) -> str:
    """One line per run; TTFTs in virtual seconds."""
    cells = [[h for h, *_ in COLUMNS]]
    for row in rows:
        cells.append([_cell(row[key], key, fmt) for _, key, fmt in COLUMNS])
    widths = [max(len(line[c]) for line in cells) for c in range(len(COLUMNS))]
    lines = [" ".join(f"{v:>{w}}" for v, w in zip(line, widths)) for line in cells]
    return "\n".join([f" {title} ".center(len(lines[0]), "="), *lines])


def _cell(value: Any, key: str, fmt: str) -> str:
    return fmt.format(value / 1000 if key.endswith("_ms") else value)
