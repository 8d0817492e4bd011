"""`radixserve bench simulate`: policies x cache sizes through the real scheduler, no model.

Each configuration runs the workload through `Simulation` and reports its hit rate (and how
close to the optimum), virtual queueing delay, TTFT and makespan, and the scheduler's real
CPU time per step; a table on stdout, every number in `<out>/simulate.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixserve.cli_args import add_dataclass_args
from radixserve.config import CacheConfig, HiCacheConfig, SchedulerConfig
from radixserve_bench.common import (
    WorkloadArgs,
    build_workloads,
    from_args,
    load_tokenizer,
    write_json,
)
from radixserve_bench.hit_rate import max_hit_rate
from radixserve_bench.metrics import latency_stats
from radixserve_bench.sim_runner import CostModel
from radixserve_bench.simulate import SimLoad, SimResult, simulate

AT_MAX_BATCH = 0.9  # steps with at least this share of the largest batch count as "at max"
CPU_BUCKET = 32  # per-step CPU time is also reported per bucket of this many batch requests


@dataclass
class SimulateArgs:
    """What to compare, and how requests arrive."""

    policies: str = "lpm,dfs-weight,fcfs"
    """Comma-separated scheduling policies to compare."""
    cache_tokens: str = "65536,262144"
    """Comma-separated KV pool sizes in tokens (max_total_tokens) to compare."""
    page_size: int = 16
    """Tokens per KV page."""
    max_running_requests: int = 256
    """Most requests in the running batch."""
    chunked_prefill_size: int = 2048
    """Most prefill tokens one step computes (-1: no limit)."""
    max_prefill_tokens: int = 16384
    """Most prefill tokens admitted per step."""
    hicache_ratio: float = 0.0
    """A hierarchical cache's host tier of this many times the pool (0: no tier)."""
    schedule_tier_match_weight: float = 0.0
    """--schedule-tier-match-weight: what a tier-only cached token counts for in lpm."""
    request_rate: float = math.inf
    """Requests per virtual second, Poisson (inf: all at once)."""
    max_concurrency: int | None = None
    """Most requests in flight at once (default: no limit)."""
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival times (1: Poisson)."""
    torch_threads: int = 1
    """torch intra-op threads while simulating: the scheduler's tensors are tiny, and more
    threads only add OpenMP wake-ups to the measured CPU time (0: leave torch's setting)."""
    out: str = "bench_results/simulate"
    """Folder for simulate.json."""
    progress: bool = True
    """Print a line per configuration as it finishes."""
    log_level: str = "warning"
    """debug | info | warning | error."""


def add_simulate_parser(modes) -> None:
    """Adds `bench simulate` to the `bench` modes (argparse subparsers)."""
    parser = modes.add_parser(
        "simulate", help="the real scheduler and radix cache at scale, a cost model for the model"
    )
    add_dataclass_args(parser, WorkloadArgs, "workload")
    add_dataclass_args(parser, SimulateArgs, "simulation")
    add_dataclass_args(parser, CostModel, "cost model (virtual seconds)")


def run_simulate_bench(args: argparse.Namespace) -> int:
    """Entry point of `radixserve bench simulate`."""
    spec, sim = from_args(WorkloadArgs, args), from_args(SimulateArgs, args)
    cost = from_args(CostModel, args)
    workload, _ = build_workloads(spec, load_tokenizer(None), 0)
    try:
        rows = run_grid(workload, sim, cost, spec.seed)
    except ValueError as exc:
        raise SystemExit(f"radixserve bench simulate: {exc}") from None
    title = f"{workload.name} ({spec.preset}), {len(workload.requests)} requests"
    print(format_table(rows, title))
    path = write_json(Path(sim.out) / "simulate.json", rows, run_config(workload, sim, cost))
    print(f"wrote {path}")
    return 0 if all(r["completed"] > 0 for r in rows) else 1


def run_config(workload, sim: SimulateArgs, cost: CostModel) -> dict[str, Any]:
    """The configuration block of simulate.json."""
    return {
        "workload": workload.name,
        "workload_config": workload.config,
        "num_requests": len(workload.requests),
        "simulation": dataclasses.asdict(sim),
        "cost_model": dataclasses.asdict(cost),
    }


def run_grid(workload, sim: SimulateArgs, cost: CostModel, seed: int = 0) -> list[dict[str, Any]]:
    """One summary per (cache size, policy)."""
    threads = torch.get_num_threads()
    if sim.torch_threads > 0:
        torch.set_num_threads(sim.torch_threads)
    try:
        return _run_grid(workload, sim, cost, seed)
    finally:
        torch.set_num_threads(threads)


def _run_grid(workload, sim: SimulateArgs, cost: CostModel, seed: int) -> list[dict[str, Any]]:
    load = SimLoad(sim.request_rate, sim.max_concurrency, sim.burstiness, seed)
    rows = []
    for cache_tokens in _int_list(sim.cache_tokens):
        for policy in _str_list(sim.policies):
            scheduler_config = SchedulerConfig(
                schedule_policy=policy,
                chunked_prefill_size=sim.chunked_prefill_size,
                max_prefill_tokens=sim.max_prefill_tokens,
                max_running_requests=sim.max_running_requests,
                schedule_tier_match_weight=sim.schedule_tier_match_weight,
            )
            cache_config = CacheConfig(page_size=sim.page_size, max_total_tokens=cache_tokens)
            hicache = _tier(sim.hicache_ratio)
            result = simulate(workload, scheduler_config, cache_config, cost, load, hicache=hicache)
            row = {"policy": policy, "cache_tokens": cache_tokens}
            rows.append(row | summarize(result, sim.page_size))
            if sim.progress:
                print(f"{policy} @ {cache_tokens} tokens: {result.wall_s:.1f} s", file=sys.stderr)
    return rows


def _tier(ratio: float) -> HiCacheConfig | None:
    if ratio == 0:
        return None
    return HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=ratio)


def _str_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _int_list(text: str) -> list[int]:
    return [int(item) for item in _str_list(text)]


# ---- summary -------------------------------------------------------------------------------


def summarize(result: SimResult, page_size: int) -> dict[str, Any]:
    """The reported numbers of one run: cache, virtual latencies, scheduler CPU time."""
    done = [i for i, t in enumerate(result.requests) if not t.error]
    times = [result.requests[i] for i in done]
    optimum = max_hit_rate([result.prompts[i] for i in done], page_size,
                           [result.outputs[i] for i in done])  # fmt: skip
    stats = result.stats
    return {
        "completed": len(done),
        "failed": len(result.requests) - len(done),
        "prompt_tokens": stats["prompt_tokens"],
        "cached_tokens": stats["cached_tokens"],
        "cache_hit_rate": stats["cache_hit_rate"],
        "max_cache_hit_rate": optimum,
        "cache_hit_rate_of_max": stats["cache_hit_rate"] / optimum if optimum else None,
        **latency_stats("queue", [t.admitted - t.sent for t in times]),
        **latency_stats(
            "ttft", [t.first_token - t.sent for t in times if t.first_token is not None]
        ),
        **latency_stats("e2el", [t.finished - t.sent for t in times]),
        "makespan_s": result.makespan,
        "steps": len(result.step_cpu_s),
        **cpu_stats(result.step_cpu_s, result.step_num_reqs),
        "evicted_pages": stats["evicted_pages"],
        "retractions": stats["retractions"],
        "wall_s": result.wall_s,
    }


def cpu_stats(cpu_s: list[float], num_reqs: list[int]) -> dict[str, Any]:
    """Scheduler CPU ms per step: overall, at the largest batches, and per batch-size bucket."""
    ms, batch = np.asarray(cpu_s) * 1000.0, np.asarray(num_reqs)
    if ms.size == 0:
        return {"max_batch": 0}
    at_max = ms[batch >= AT_MAX_BATCH * batch.max()]
    buckets = batch // CPU_BUCKET * CPU_BUCKET
    return {
        "mean_cpu_ms": float(ms.mean()),
        "p99_cpu_ms": float(np.percentile(ms, 99)),
        "max_batch": int(batch.max()),
        "steps_at_max_batch": int(at_max.size),
        "mean_cpu_ms_at_max_batch": float(at_max.mean()),
        "p99_cpu_ms_at_max_batch": float(np.percentile(at_max, 99)),
        "mean_cpu_ms_by_batch": {
            int(b): float(ms[buckets == b].mean()) for b in np.unique(buckets)
        },
    }


# ---- report --------------------------------------------------------------------------------

COLUMNS: list[tuple[str, str, str, float]] = [  # header, key, format, scale
    ("policy", "policy", "s", 1), ("cache tok", "cache_tokens", "d", 1),
    ("hit", "cache_hit_rate", ".3f", 1), ("/opt", "cache_hit_rate_of_max", ".3f", 1),
    ("queue s", "mean_queue_ms", ".2f", 1e-3), ("q p50", "median_queue_ms", ".2f", 1e-3),
    ("q p99", "p99_queue_ms", ".2f", 1e-3), ("ttft s", "mean_ttft_ms", ".2f", 1e-3),
    ("t p50", "median_ttft_ms", ".2f", 1e-3), ("t p99", "p99_ttft_ms", ".2f", 1e-3),
    ("makespan s", "makespan_s", ".1f", 1), ("steps", "steps", "d", 1),
    ("cpu ms", "mean_cpu_ms", ".3f", 1), ("cpu p99", "p99_cpu_ms", ".3f", 1),
    ("max batch", "max_batch", "d", 1), ("cpu@max", "mean_cpu_ms_at_max_batch", ".3f", 1),
    ("p99@max", "p99_cpu_ms_at_max_batch", ".3f", 1), ("evicted", "evicted_pages", "d", 1),
    ("retract", "retractions", "d", 1),
]  # fmt: skip


def format_table(rows: list[dict[str, Any]], title: str = "") -> str:
    """One line per configuration; latencies are virtual seconds, CPU times real ms."""
    cells = [[h for h, *_ in COLUMNS]]
    for row in rows:
        cells.append([_cell(row.get(key), fmt, scale) for _, key, fmt, scale in COLUMNS])
    widths = [max(len(line[c]) for line in cells) for c in range(len(COLUMNS))]
    lines = [" ".join(f"{v:>{w}}" for v, w in zip(line, widths)) for line in cells]
    width = len(lines[0])
    return "\n".join([f" {title} ".center(width, "="), *lines, "=" * width])


def _cell(value: Any, fmt: str, scale: float) -> str:
    if value is None:
        return "-"
    if fmt == "s":
        return str(value)
    return format(int(value) if fmt == "d" else value * scale, fmt)
