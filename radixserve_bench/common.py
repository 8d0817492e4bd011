"""What every `radixserve bench` mode shares: the workload and report options (each field's
docstring is its `--help`), and the steps around a run: the workloads, the tokenizer, the
configuration block of bench.json, the table and the files. Modes (cli.py, compare.py,
simulate_cli.py, retention_bench.py) import from here, never from each other."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.cli_args import add_dataclass_args, field_names
from radixserve_bench.client import LoadShape


@dataclass
class WorkloadArgs:
    """Which requests to send."""

    workload: str = "shared-prefix"
    """shared-prefix | multi-turn | agent | fork | tool-echo (answers quote a tool result) |
    agent-sessions (pauses: simulate only)."""
    preset: str = "default"
    """default (GPU sizes) | small (about two minutes per system on 2 CPU cores)."""
    workload_args: str | None = None
    """Size overrides of the workload, e.g. num_groups=4,output_len=16."""
    seed: int = 0
    """Seed of the workload's text, order and arrival times."""


@dataclass
class ReportArgs:
    """Where results go."""

    out: str = "bench_results/bench"
    """Folder for bench.json and the PNG plots."""
    system: str | None = None
    """Name of the measured system in the table and plots (default: the backend)."""
    progress: bool = True
    """Show a progress bar while requests run."""
    log_level: str = "warning"
    """debug | info | warning | error."""


def add_common_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, WorkloadArgs, "workload")
    add_dataclass_args(parser, LoadShape, "load")
    add_dataclass_args(parser, ReportArgs, "report")


def from_args(cls: type, args: argparse.Namespace):
    """An instance of dataclass `cls` from the parsed options of the same names."""
    return cls(**{name: getattr(args, name) for name in field_names(cls)})


def build_workloads(spec: WorkloadArgs, tokenizer, num_warmup: int):
    """The measured workload and the warm-up one, from the options."""
    from radixserve_bench.workloads import make_workload, parse_overrides, warmup_workload

    try:
        overrides = parse_overrides(spec.workload_args)
        workload = make_workload(spec.workload, tokenizer, spec.seed, spec.preset, overrides)
    except ValueError as exc:
        raise SystemExit(f"radixserve bench: {exc}") from None
    return workload, warmup_workload(tokenizer, num_warmup, spec.seed)


def load_tokenizer(path: str | None):
    from radixserve_bench.workloads import default_tokenizer

    if path is None:
        return default_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def common_args(args: argparse.Namespace) -> tuple[WorkloadArgs, LoadShape, ReportArgs]:
    return from_args(WorkloadArgs, args), from_args(LoadShape, args), from_args(ReportArgs, args)


def run_config(mode: str, workload, load: LoadShape, target: dict[str, Any]) -> dict[str, Any]:
    """The configuration block of bench.json."""
    return {
        "mode": mode,
        "workload": workload.name,
        "workload_config": workload.config,
        "num_requests": len(workload.requests),
        "load": dataclasses.asdict(load),
        "target": target,
    }


def finish(runs, report: ReportArgs, config: dict[str, Any]) -> int:
    """Prints the table, writes the files; exit status 1 if a run completed nothing."""
    from radixserve_bench.report import format_table, write_report

    title = f"{config['workload']} ({config['workload_config'].get('preset')})"
    print(format_table(runs, title))
    for run in runs:
        errors = [r.error for r in run.results if not r.success]
        if errors:
            print(f"{run.system}: {len(errors)} failed; first: {errors[0]}", file=sys.stderr)
    paths = write_report(Path(report.out), runs, config)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r.metrics["completed"] > 0 for r in runs) else 1


def write_json(path: Path, rows: list[dict[str, Any]], config: dict[str, Any]) -> Path:
    """The configuration, the environment and one summary per simulated configuration."""
    from radixserve_bench.report import write_results

    return write_results(path, config, rows)
