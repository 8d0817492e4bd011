"""`radixserve bench compare`: one workload through several systems, one after another, on
the same requests, and radixserve's speedup over each beside its limit.

The limit is the workload's ideal speedup: the work with no prefix sharing over the work with
perfect sharing (every distinct prompt page prefilled once, decode unchanged). Its prefill
cost per token is measured on the first radixserve server of this run; its decode cost is
the fastest any system of the run shows at the workload's context and concurrency, because a
slow decode of ours would dilute the prefill savings and flatter us. Both ideals are printed:
priced with radixserve's own decode and with the fastest.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve_bench.client import LoadShape
from radixserve_bench.record import BenchRun
from radixserve_bench.systems import LaunchOptions, SystemSpec

REFERENCE = "radixserve"
# Where a system has a target in the benchmark issue: (speedup target, in units of the ideal?)
SPEEDUP_TARGETS = {
    "radixserve-no-cache": (0.85, True),
    "hf-transformers": (1.0, True),
    "llama-cpp": (2.0, False),
    "llama-server": (2.0, False),
}
HIT_RATE_TARGET = 0.98  # radixserve's hit rate as a fraction of the optimum
FOLLOWUP_TTFT_TARGET = 0.25  # radixserve's P99 follow-up TTFT over the cache-off run's


@dataclass
class CompareArgs:
    """Which systems to compare."""

    systems: str = "radixserve,radixserve-no-cache,radixserve-fcfs,hf-transformers,llama-cpp"
    """Comma-separated, measured in this order; unavailable ones are skipped with the reason."""
    calibrate: bool = True
    """Measure every system's per-token prefill and decode costs before its run, for the
    ideal speedup (radixserve's prefill, the fastest decode)."""
    max_run_seconds: float | None = None
    """Cap on each system's measured run and on each of its calibration probes, in seconds;
    requests still out then count as failed, so a slow peer reports what it reached."""


@dataclass(frozen=True)
class TokenCosts:
    """Seconds per prefilled and per decoded token, measured side by side."""

    prefill_s: float
    decode_s: float
    probe: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)


def ideal_speedup(
    prompt_tokens: int, max_hit_rate: float, output_tokens: int, costs: TokenCosts
) -> float:
    """Work without sharing over work with perfect sharing (decode is the same in both)."""
    decode = output_tokens * costs.decode_s
    unshared = prompt_tokens * costs.prefill_s + decode
    shared = prompt_tokens * (1.0 - max_hit_rate) * costs.prefill_s + decode
    return unshared / shared if shared > 0 else math.nan


def probe_workload(
    name: str, num: int, prompt_len: int, output_len: int, seed: int, shared_len: int = 0
):
    """`num` random-token prompts of `prompt_len`: the first `shared_len` tokens common to all,
    the rest (at least the first token after them) different in each."""
    from radixserve_bench.workloads import BenchRequest, Workload

    rng = random.Random(seed)
    shared = [rng.randrange(1000, 30000) for _ in range(shared_len)]
    firsts = rng.sample(range(1000, 30000), num)
    requests = []
    for i, first in enumerate(firsts):
        rest = [rng.randrange(1000, 30000) for _ in range(prompt_len - shared_len - 1)]
        requests.append(BenchRequest(None, shared + [first] + rest, output_len, conversation=i))
    config = {"prompt_len": prompt_len, "shared_len": shared_len, "output_len": output_len}
    return Workload(name, requests, config)


async def measure_token_costs(
    backend, num_prefill: int, prompt_len: int, concurrency: int, output_len: int, seed: int = 0,
    time_limit: float | None = None,
) -> TokenCosts:  # fmt: skip
    """Per-token costs at the workload's shape, on the server behind `backend`.

    Prefill: `num_prefill` unrelated prompts of `prompt_len` tokens, one output token each.
    Decode: `concurrency` prompts of `prompt_len` tokens decoding `output_len` tokens together,
    so that attention reads contexts as long as the workload's; they share all but their last
    8 tokens, so that a caching server prefills little, and what it does prefill (its own
    count where it reports one) is priced at the prefill cost and taken out.
    """
    from radixserve_bench.client import run_online

    prefill_run = await run_online(
        probe_workload("probe-prefill", num_prefill, prompt_len, 1, seed), backend,
        LoadShape(max_concurrency=num_prefill, num_warmup=0), system="probe-prefill",
        progress=False, time_limit=time_limit,
    )  # fmt: skip
    shared_len = max(prompt_len - 8, 0)
    decode_run = await run_online(
        probe_workload("probe-decode", concurrency, prompt_len, output_len, seed + 1, shared_len),
        backend, LoadShape(max_concurrency=concurrency, num_warmup=0), system="probe-decode",
        progress=False, time_limit=time_limit,
    )  # fmt: skip
    for run in (prefill_run, decode_run):
        if run.metrics["failed"]:
            first = next(r.error for r in run.results if not r.success)
            raise RuntimeError(f"{run.system} failed: {first}")
    pm, dm = prefill_run.metrics, decode_run.metrics
    prefill_s = pm["duration"] / pm["total_input_tokens"]
    counters = decode_run.info.get("engine_counters") or {}
    reported = dm["total_input_tokens"] - dm.get("total_cached_tokens", 0)
    prefilled = counters.get("prefill_tokens_computed", reported)
    decode_time = dm["duration"] - prefilled * prefill_s
    decode_s = max(decode_time, 0.0) / dm["total_output_tokens"]
    probe = {
        "num_prefill": num_prefill, "prompt_len": prompt_len, "concurrency": concurrency,
        "output_len": output_len, "prefill_duration": pm["duration"],
        "decode_duration": dm["duration"], "decode_prefilled_tokens": prefilled,
    }  # fmt: skip
    return TokenCosts(prefill_s, decode_s, probe)


def fastest_decode(costs: dict[str, TokenCosts]) -> tuple[str, float] | None:
    """(system, seconds per decoded token) of the fastest decode measured in the run; a probe
    whose prefill pricing left no decode time (0) tells nothing and is passed over."""
    measured = {n: c.decode_s for n, c in costs.items() if c.decode_s > 0}
    if not measured:
        return None
    name = min(measured, key=measured.get)
    return name, measured[name]


def ideal_pricing(m: dict[str, Any], costs: dict[str, TokenCosts], reference: str) -> dict:
    """The ideal speedup with the reference's own decode cost and with the fastest one."""
    if reference not in costs:
        return {"ideal_speedup": None}
    own = costs[reference]
    name, decode_s = fastest_decode(costs) or (reference, own.decode_s)
    shape = (m["total_input_tokens"], m["max_cache_hit_rate"], m["total_output_tokens"])
    fastest = dataclasses.replace(own, decode_s=decode_s)
    return {
        "ideal_speedup": ideal_speedup(*shape, fastest),
        "ideal_speedup_own_decode": ideal_speedup(*shape, own),
        "decode_priced_by": name,
        "decode_s": decode_s,
    }


def compare_runs(
    runs: list[BenchRun], costs: dict[str, TokenCosts], reference: str = REFERENCE
) -> dict[str, Any]:
    """radixserve's speedup over each other system, its ideal, and the issue's targets;
    `costs` holds each calibrated system's per-token costs."""
    by_name = {r.system: r for r in runs}
    ref = by_name.get(reference)
    if ref is None or not ref.metrics.get("completed"):
        return {"reference": reference, "rows": [], "ideal_speedup": None}
    m = ref.metrics
    pricing = ideal_pricing(m, costs, reference)
    ideal = pricing["ideal_speedup"]
    rows = []
    for run in runs:
        if run is ref or not run.metrics.get("completed"):
            continue
        # a run cut short by --max-run-seconds (or with failures) has no comparable duration
        complete = not run.metrics.get("failed")
        speedup = run.metrics["duration"] / m["duration"] if complete else None
        # the ideal is the limit over a system that shares no prefix; one that does has none
        limit = ideal if not run.metrics.get("total_cached_tokens") else None
        row = {"system": run.system, "weights": run.info.get("weights"), "speedup": speedup,
               "ideal_speedup": limit, "of_ideal": speedup / limit if limit and speedup else None,
               "completed": run.metrics["completed"]}  # fmt: skip
        target = SPEEDUP_TARGETS.get(run.system)
        if target is not None:
            value, relative = target
            row["target"] = value * ideal if relative and ideal else (None if relative else value)
        if "p99_ttft_followup_ms" in m and "p99_ttft_followup_ms" in run.metrics:
            row["p99_ttft_followup_ratio"] = (
                m["p99_ttft_followup_ms"] / run.metrics["p99_ttft_followup_ms"]
            )
        rows.append(row)
    return {
        "reference": reference,
        **pricing,
        "hit_rate_of_max": m["cache_hit_rate_of_max"],
        "rows": rows,
    }


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_costs(comparison: dict[str, Any], costs: dict[str, TokenCosts]) -> list[str]:
    """Each system's measured costs and the ideal priced both ways."""
    lines = [f"measured cost per token ({name}): prefill {c.prefill_s * 1e3:.3f} ms, "
             f"decode {c.decode_s * 1e3:.3f} ms" for name, c in costs.items()]  # fmt: skip
    if comparison.get("ideal_speedup") is not None:
        lines.append(
            f"ideal speedup: {comparison['ideal_speedup_own_decode']:.2f}x with "
            f"{comparison['reference']}'s decode, {comparison['ideal_speedup']:.2f}x with the "
            f"fastest ({comparison['decode_priced_by']}, {comparison['decode_s'] * 1e3:.3f} ms; "
            "used below)"
        )
    return lines


def format_comparison(comparison: dict[str, Any], costs: dict[str, TokenCosts]) -> str:
    """The comparison table: radixserve's speedup over each system beside its limit/target."""
    lines = [f"{' radixserve vs peers ':=^100}", *format_costs(comparison, costs)]
    hit = comparison.get("hit_rate_of_max")
    if hit is not None:
        verdict = "met" if hit >= HIT_RATE_TARGET else "MISSED"
        lines.append(f"hit rate / optimum: {hit:.3f} (target >= {HIT_RATE_TARGET}: {verdict})")
    header = f"{'system':<22}{'weights':<14}{'speedup':>9}{'ideal':>9}{'of ideal':>10}"
    lines += [header + f"{'target':>9}{'P99 TTFT follow-up ratio':>27}", "-" * 100]
    for row in comparison["rows"]:
        target = row.get("target")
        verdict = (
            ""
            if target is None or row["speedup"] is None
            else (" met" if row["speedup"] >= target else " MISSED")
        )
        ratio = row.get("p99_ttft_followup_ratio")
        followup = _fmt(ratio, ".3f")
        if ratio is not None and row["system"] == "radixserve-no-cache":
            followup += " met" if ratio <= FOLLOWUP_TTFT_TARGET else " MISSED"
        lines.append(
            f"{row['system']:<22}{row.get('weights') or '-':<14}"
            f"{_fmt(row['speedup'], '.2f') + ('x' if row['speedup'] else ''):>9}"
            f"{_fmt(row['ideal_speedup'], '.2f'):>9}"
            f"{_fmt(row['of_ideal'], '.1%'):>10}{_fmt(target, '.2f'):>9}{verdict:<7}"
            f"{followup:>20}"
        )
    return "\n".join(lines)


def add_compare_parser(modes) -> None:
    """`bench compare` and its options."""
    from radixserve.cli_args import add_dataclass_args
    from radixserve_bench.common import add_common_args

    parser = modes.add_parser("compare", help="start several systems and measure them side by side")
    add_dataclass_args(parser, CompareArgs, "systems")
    add_dataclass_args(parser, LaunchOptions, "servers")
    add_common_args(parser)


def run_compare_bench(args: argparse.Namespace) -> int:
    """Entry point of `radixserve bench compare`."""
    from radixserve_bench.common import common_args, from_args, run_config
    from radixserve_bench.systems import parse_systems

    spec, load, report = common_args(args)
    options, compare = from_args(LaunchOptions, args), from_args(CompareArgs, args)
    try:
        systems = parse_systems(compare.systems)
    except ValueError as exc:
        raise SystemExit(f"radixserve bench compare: {exc}") from None
    from radixserve.model.tokenizer import model_tokenizer
    from radixserve_bench.common import build_workloads, finish

    tokenizer = model_tokenizer(options.model)  # every system gets prompts built with it
    workload, warmup = build_workloads(spec, tokenizer, load.num_warmup)
    runs, costs, skipped = _measure_all(systems, workload, warmup, tokenizer, spec.seed, load,
                                        report, options, compare)  # fmt: skip
    if not runs:
        raise SystemExit(f"radixserve bench compare: no system ran: {skipped}")
    comparison = compare_runs(runs, costs)
    config = run_config("compare", workload, load, dataclasses.asdict(options))
    config |= {"skipped": skipped, "comparison": comparison,
               "token_costs": {n: dataclasses.asdict(c) for n, c in costs.items()}}  # fmt: skip
    status = finish(runs, report, config)
    print(format_comparison(comparison, costs))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}", file=sys.stderr)
    return status


def _measure_all(
    systems: list[SystemSpec], workload, warmup, tokenizer, seed: int, load: LoadShape, report,
    options: LaunchOptions, compare: CompareArgs,
):  # fmt: skip
    """Starts, calibrates, measures and stops each system in turn."""
    from radixserve_bench.backends import make_backend
    from radixserve_bench.client import run_online
    from radixserve_bench.systems import launch, unavailable_reason

    max_batch = load.max_concurrency or 16
    runs: list[BenchRun] = []
    skipped: dict[str, str] = {}
    costs: dict[str, TokenCosts] = {}
    log_dir = Path(report.out) / "logs"
    seq_len = max_seq_len(workload)
    for system in systems:
        reason = unavailable_reason(system, options)
        if reason is not None:
            skipped[system.name] = reason
            continue
        print(f"starting {system.name} ...", file=sys.stderr, flush=True)
        try:
            server = launch(system, options, max_batch, log_dir, seq_len)
        except RuntimeError as exc:
            skipped[system.name] = f"did not start: {exc}"
            continue
        with server:
            backend = make_backend(system.backend, server.url, tokenizer, None, None)
            cost = _calibrate_or_none(backend, workload, max_batch, seed, compare)
            if cost is not None:
                costs[system.name] = cost
            run = asyncio.run(
                run_online(workload, backend, load, seed, warmup, None, system.name,
                           report.progress, compare.max_run_seconds)
            )  # fmt: skip
            run.info |= {"command": server.command, "weights": system.weights}
            runs.append(run)
    return runs, costs, skipped


def max_seq_len(workload) -> int:
    """Tokens a server must hold for one request: the longest prompt plus the longest output
    (at least the decode probe's 8)."""
    longest_output = max((r.output_len for r in workload.requests), default=0)
    return max(map(len, workload.prompts()), default=0) + max(longest_output, 8)


def _calibrate_or_none(backend, workload, max_batch: int, seed: int, compare: CompareArgs):
    """The system's token costs, or None when not asked for or (said on stderr) when a probe
    failed or ran out of time: the ideal is then priced without it."""
    if not compare.calibrate:
        return None
    try:
        return asyncio.run(_calibrate(backend, workload, max_batch, seed, compare.max_run_seconds))
    except RuntimeError as exc:
        print(f"calibration failed: {exc}", file=sys.stderr)
        return None


async def _calibrate(
    backend, workload, max_batch: int, seed: int, time_limit: float | None
) -> TokenCosts:
    """Token costs at the workload's mean prompt and output lengths and its concurrency
    (the prefill probe capped at 8192 tokens, so it stays short on a CPU)."""
    prompts = workload.prompts()
    mean_prompt = sum(map(len, prompts)) // max(len(prompts), 1)
    mean_output = sum(r.output_len for r in workload.requests) // max(len(workload.requests), 1)
    prompt_len = max(16, min(mean_prompt, 2048))
    num = max(1, min(max_batch, 8192 // prompt_len))
    return await measure_token_costs(backend, num, prompt_len, max_batch, max(mean_output, 8),
                                     seed, time_limit)  # fmt: skip
