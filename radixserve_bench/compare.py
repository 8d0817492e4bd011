"""`radixserve bench compare`: one workload through several systems, one after another, on
the same requests, and radixserve's speedup over each beside its limit.

The limit is the workload's ideal speedup: the work with no prefix sharing over the work with
perfect sharing (every distinct prompt page prefilled once, decode unchanged), priced with
per-token prefill and decode costs measured on the first radixserve server of this run.
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
}
HIT_RATE_TARGET = 0.98  # radixserve's hit rate as a fraction of the optimum
FOLLOWUP_TTFT_TARGET = 0.25  # radixserve's P99 follow-up TTFT over the cache-off run's


@dataclass
class CompareArgs:
    """Which systems to compare."""

    systems: str = "radixserve,radixserve-no-cache,radixserve-fcfs,hf-transformers,llama-cpp"
    """Comma-separated, measured in this order; unavailable ones are skipped with the reason."""
    calibrate: bool = True
    """Measure per-token prefill and decode costs first, for the ideal speedup."""


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
    backend, num_prefill: int, prompt_len: int, concurrency: int, output_len: int, seed: int = 0
) -> TokenCosts:
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
        progress=False,
    )  # fmt: skip
    shared_len = max(prompt_len - 8, 0)
    decode_run = await run_online(
        probe_workload("probe-decode", concurrency, prompt_len, output_len, seed + 1, shared_len),
        backend, LoadShape(max_concurrency=concurrency, num_warmup=0), system="probe-decode",
        progress=False,
    )  # fmt: skip
    for run in (prefill_run, decode_run):
        if run.metrics["failed"]:
            first = next(r.error for r in run.results if not r.success)
            raise RuntimeError(f"{run.system} failed: {first}")
    pm, dm = prefill_run.metrics, decode_run.metrics
    prefill_s = pm["duration"] / pm["total_input_tokens"]
    counters = decode_run.info.get("engine_counters") or {}
    prefilled = counters.get("prefill_tokens_computed", dm["total_input_tokens"])
    decode_time = dm["duration"] - prefilled * prefill_s
    decode_s = max(decode_time, 0.0) / dm["total_output_tokens"]
    probe = {
        "num_prefill": num_prefill, "prompt_len": prompt_len, "concurrency": concurrency,
        "output_len": output_len, "prefill_duration": pm["duration"],
        "decode_duration": dm["duration"], "decode_prefilled_tokens": prefilled,
    }  # fmt: skip
    return TokenCosts(prefill_s, decode_s, probe)


def compare_runs(
    runs: list[BenchRun], costs: TokenCosts | None, reference: str = REFERENCE
) -> dict[str, Any]:
    """radixserve's speedup over each other system, its ideal, and the issue's targets."""
    by_name = {r.system: r for r in runs}
    ref = by_name.get(reference)
    if ref is None or not ref.metrics.get("completed"):
        return {"reference": reference, "rows": [], "ideal_speedup": None}
    m = ref.metrics
    ideal = None
    if costs is not None:
        ideal = ideal_speedup(m["total_input_tokens"], m["max_cache_hit_rate"],
                              m["total_output_tokens"], costs)  # fmt: skip
    rows = []
    for run in runs:
        if run is ref or not run.metrics.get("completed"):
            continue
        speedup = run.metrics["duration"] / m["duration"]
        # the ideal is the limit over a system that shares no prefix; one that does has none
        limit = ideal if not run.metrics.get("total_cached_tokens") else None
        row = {"system": run.system, "speedup": speedup, "ideal_speedup": limit,
               "of_ideal": speedup / limit if limit else None}  # fmt: skip
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
        "ideal_speedup": ideal,
        "hit_rate_of_max": m["cache_hit_rate_of_max"],
        "rows": rows,
    }


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_comparison(comparison: dict[str, Any], costs: TokenCosts | None) -> str:
    """The comparison table: radixserve's speedup over each system beside its limit/target."""
    lines = [f"{' radixserve vs peers ':=^86}"]
    if costs is not None:
        lines.append(f"measured cost per token: prefill {costs.prefill_s * 1e3:.3f} ms, "
                     f"decode {costs.decode_s * 1e3:.3f} ms")  # fmt: skip
    hit = comparison.get("hit_rate_of_max")
    if hit is not None:
        verdict = "met" if hit >= HIT_RATE_TARGET else "MISSED"
        lines.append(f"hit rate / optimum: {hit:.3f} (target >= {HIT_RATE_TARGET}: {verdict})")
    header = f"{'system':<22}{'speedup':>9}{'ideal':>9}{'of ideal':>10}{'target':>9}"
    lines += [header + f"{'P99 TTFT follow-up ratio':>27}", "-" * 86]
    for row in comparison["rows"]:
        target = row.get("target")
        verdict = "" if target is None else (" met" if row["speedup"] >= target else " MISSED")
        ratio = row.get("p99_ttft_followup_ratio")
        followup = _fmt(ratio, ".3f")
        if ratio is not None and row["system"] == "radixserve-no-cache":
            followup += " met" if ratio <= FOLLOWUP_TTFT_TARGET else " MISSED"
        lines.append(
            f"{row['system']:<22}{row['speedup']:>8.2f}x{_fmt(row['ideal_speedup'], '.2f'):>9}"
            f"{_fmt(row['of_ideal'], '.1%'):>10}{_fmt(target, '.2f'):>9}{verdict:<7}"
            f"{followup:>20}"
        )
    return "\n".join(lines)


def add_compare_parser(modes) -> None:
    """`bench compare` and its options."""
    from radixserve.cli_args import add_dataclass_args
    from radixserve_bench.cli import _add_common_args

    parser = modes.add_parser("compare", help="start several systems and measure them side by side")
    add_dataclass_args(parser, CompareArgs, "systems")
    add_dataclass_args(parser, LaunchOptions, "servers")
    _add_common_args(parser)


def run_compare_bench(args: argparse.Namespace) -> int:
    """Entry point of `radixserve bench compare`."""
    from radixserve_bench.cli import common_args, from_args, run_config
    from radixserve_bench.systems import parse_systems

    spec, load, report = common_args(args)
    options, compare = from_args(LaunchOptions, args), from_args(CompareArgs, args)
    try:
        systems = parse_systems(compare.systems)
    except ValueError as exc:
        raise SystemExit(f"radixserve bench compare: {exc}") from None
    from radixserve.model.tokenizer import model_tokenizer
    from radixserve_bench.cli import build_workloads, finish

    tokenizer = model_tokenizer(options.model)  # every system gets prompts built with it
    workload, warmup = build_workloads(spec, tokenizer, load.num_warmup)
    runs, costs, skipped = _measure_all(systems, workload, warmup, tokenizer, spec.seed, load,
                                        report, options, compare)  # fmt: skip
    if not runs:
        raise SystemExit(f"radixserve bench compare: no system ran: {skipped}")
    comparison = compare_runs(runs, costs)
    config = run_config("compare", workload, load, dataclasses.asdict(options))
    config |= {"skipped": skipped, "comparison": comparison,
               "token_costs": dataclasses.asdict(costs) if costs else None}  # fmt: skip
    status = finish(runs, report, config)
    print(format_comparison(comparison, costs))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}", file=sys.stderr)
    return status


def _measure_all(
    systems: list[SystemSpec], workload, warmup, tokenizer, seed: int, load: LoadShape, report,
    options: LaunchOptions, compare: CompareArgs,
):  # fmt: skip
    """Starts, measures and stops each system in turn; calibrates on the first radixserve."""
    from radixserve_bench.backends import make_backend
    from radixserve_bench.client import run_online
    from radixserve_bench.systems import launch, unavailable_reason

    max_batch = load.max_concurrency or 16
    runs: list[BenchRun] = []
    skipped: dict[str, str] = {}
    costs: TokenCosts | None = None
    log_dir = Path(report.out) / "logs"
    for system in systems:
        reason = unavailable_reason(system, options)
        if reason is not None:
            skipped[system.name] = reason
            continue
        print(f"starting {system.name} ...", file=sys.stderr, flush=True)
        try:
            server = launch(system, options, max_batch, log_dir)
        except RuntimeError as exc:
            skipped[system.name] = f"did not start: {exc}"
            continue
        with server:
            backend = make_backend(system.backend, server.url, tokenizer, None, None)
            if compare.calibrate and costs is None and system.kind == "radixserve":
                costs = asyncio.run(_calibrate(backend, workload, max_batch, seed))
            run = asyncio.run(
                run_online(workload, backend, load, seed, warmup, None, system.name,
                           report.progress)
            )  # fmt: skip
            run.info["command"] = server.command
            runs.append(run)
    return runs, costs, skipped


async def _calibrate(backend, workload, max_batch: int, seed: int) -> TokenCosts:
    """Token costs at the workload's mean prompt and output lengths and its concurrency
    (the prefill probe capped at 8192 tokens, so it stays short on a CPU)."""
    prompts = workload.prompts()
    mean_prompt = sum(map(len, prompts)) // max(len(prompts), 1)
    mean_output = sum(r.output_len for r in workload.requests) // max(len(workload.requests), 1)
    prompt_len = max(16, min(mean_prompt, 2048))
    num = max(1, min(max_batch, 8192 // prompt_len))
    return await measure_token_costs(backend, num, prompt_len, max_batch, max(mean_output, 8),
                                     seed)  # fmt: skip
