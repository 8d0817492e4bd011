"""Reports: a table on stdout (one column per system), `bench.json` with every number and the
environment, and PNG plots (throughput per system, TTFT and E2E CDFs, hit rate vs optimum)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from radixserve.native.machine import cpu_model, describe_cpu
from radixserve_bench.record import BenchRun

SECTIONS: list[tuple[str, list[tuple[str, str, str]]]] = [
    ("Serving Benchmark Result", [
        ("Successful requests", "completed", "d"),
        ("Failed requests", "failed", "d"),
        ("Maximum request concurrency", "max_concurrency", "d"),
        ("Request rate configured (RPS)", "request_rate", ".2f"),
        ("Benchmark duration (s)", "duration", ".2f"),
        ("Total input tokens", "total_input_tokens", "d"),
        ("Total generated tokens", "total_output_tokens", "d"),
        ("Request throughput (req/s)", "request_throughput", ".2f"),
        ("Input token throughput (tok/s)", "input_throughput", ".2f"),
        ("Output token throughput (tok/s)", "output_throughput", ".2f"),
        ("Peak output token throughput (tok/s)", "max_output_tokens_per_s", ".2f"),
        ("Peak concurrent requests", "max_concurrent_requests", "d"),
        ("Total token throughput (tok/s)", "total_token_throughput", ".2f"),
        ("Concurrency", "concurrency", ".2f"),
    ]),
    *[(title, [(f"{stat.capitalize()} {label} (ms)", f"{key}_{name}_ms", ".2f")
               for stat, key in (("mean", "mean"), ("median", "median"), ("P90", "p90"),
                                 ("P99", "p99"))])
      for title, label, name in (
          ("Time to First Token", "TTFT", "ttft"),
          ("TTFT of follow-up turns", "TTFT", "ttft_followup"),
          ("Time per Output Token (excl. 1st token)", "TPOT", "tpot"),
          ("Inter-token Latency", "ITL", "itl"),
          ("End-to-end Latency", "E2EL", "e2el"),
      )],
    ("Prefix Cache", [
        ("Cached prompt tokens", "total_cached_tokens", "d"),
        ("Cache hit rate", "cache_hit_rate", ".3f"),
        ("Theoretical max hit rate", "max_cache_hit_rate", ".3f"),
        ("Hit rate / optimum", "cache_hit_rate_of_max", ".3f"),
    ]),
]  # fmt: skip
LABEL_WIDTH, COLUMN_WIDTH = 42, 14


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return format(int(value) if fmt == "d" else value, fmt)


def format_table(runs: list[BenchRun], title: str = "") -> str:
    """vLLM-style result block; several runs become side-by-side columns."""
    width = LABEL_WIDTH + COLUMN_WIDTH * len(runs)
    lines = [f" {title} ".center(width, "=")] if title else []
    lines.append(
        f"{'System':<{LABEL_WIDTH}}" + "".join(f"{r.system:>{COLUMN_WIDTH}}" for r in runs)
    )
    for section, rows in SECTIONS:
        present = [row for row in rows if any(row[1] in r.metrics for r in runs)]
        if present:
            lines.append(f" {section} ".center(width, "-"))
        for label, key, fmt in present:
            cells = "".join(f"{_cell(r.metrics.get(key), fmt):>{COLUMN_WIDTH}}" for r in runs)
            lines.append(f"{label + ':':<{LABEL_WIDTH}}{cells}")
    lines.append("=" * width)
    return "\n".join(lines)


# ---- environment ---------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """Where the numbers came from: machine, versions, commit, time."""
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_features": describe_cpu(),
        "num_cpus": os.cpu_count(),
        "gpu": gpu_name(),
        "python": platform.python_version(),
        **{name: package_version(name) for name in ("radixserve", "torch", "transformers")},
        **git_state(),
    }


def gpu_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_state() -> dict[str, Any]:
    """The commit of the radixserve checkout, and whether it had local changes."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                 timeout=10)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": bool(dirty) if commit else None}


# ---- files ---------------------------------------------------------------------------------


def write_json(path: Path, runs: list[BenchRun], config: dict[str, Any]) -> Path:
    """`bench.json`: the run configuration, the environment, and every run with its requests."""
    return write_results(path, config, [r.to_json() for r in runs])


def write_results(path: Path, config: dict[str, Any], runs: list[dict[str, Any]]) -> Path:
    """A results file: the configuration, the environment and one entry per run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": config, "environment": environment(), "runs": runs}
    path.write_text(json.dumps(_strict_json(doc), indent=1, default=str))
    return path


def save_report(report: dict[str, Any], out: Path | str) -> Path:
    """A script's report as JSON at `out` (its folder made), non-finite floats as strings."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_strict_json(report), indent=2))
    return path


def _strict_json(value: Any) -> Any:
    """Non-finite floats as strings ("inf"), so that any JSON parser reads the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def write_report(out_dir: Path | str, runs: list[BenchRun], config: dict[str, Any]) -> list[Path]:
    """Writes bench.json and the plots into `out_dir`; returns the paths written."""
    from radixserve_bench.plots import write_plots

    out_dir = Path(out_dir)
    paths = [write_json(out_dir / "bench.json", runs, config)]
    try:
        return paths + write_plots(out_dir, runs)
    except ImportError:
        print("no plots: matplotlib is missing (pip install 'radixserve[bench]')", file=sys.stderr)
        return paths
