"""PNG plots of one or more runs (matplotlib, headless): throughput per system, TTFT and E2E
latency CDFs, and measured cache hit rate beside the workload's optimum."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from radixserve_bench.record import BenchRun


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, runs: list[BenchRun], series: list[tuple[str, str]], ylabel: str) -> None:
    """Grouped bars: one group per system, one bar per (label, metric key)."""
    x = np.arange(len(runs))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        values = [r.metrics.get(key, 0.0) for r in runs]
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label)
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(x, [r.system for r in runs])
    ax.set_ylabel(ylabel)
    ax.legend()


def plot_throughput(path: Path, runs: list[BenchRun]) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(runs) + 3), 4))
    series = [("total tok/s", "total_token_throughput"), ("output tok/s", "output_throughput")]
    _bars(ax, runs, series, "tokens / s")
    ax.set_title("Throughput per system")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cdf(ax, values_ms: list[float], label: str) -> None:
    xs = np.sort(np.asarray(values_ms, dtype=float))
    ax.plot(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), label=label)


def plot_latency_cdfs(path: Path, runs: list[BenchRun]) -> Path:
    """TTFT and E2E latency CDFs side by side, one line per system."""
    plt = _pyplot()
    fig, (ttft_ax, e2e_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        ok = [r for r in run.results if r.success]
        _cdf(ttft_ax, [r.ttft * 1000 for r in ok if r.ttft is not None], run.system)
        _cdf(e2e_ax, [r.e2e * 1000 for r in ok], run.system)
    for ax, name in ((ttft_ax, "TTFT"), (e2e_ax, "E2E latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_hit_rate(path: Path, runs: list[BenchRun]) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(runs) + 3), 4))
    series = [("measured", "cache_hit_rate"), ("theoretical max", "max_cache_hit_rate")]
    _bars(ax, runs, series, "cache hit rate")
    ax.set_ylim(0, 1.1)
    ax.set_title("Prefix cache hit rate vs optimum")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(out_dir: Path, runs: list[BenchRun]) -> list[Path]:
    """throughput.png, latency_cdf.png and hit_rate.png in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_throughput(out_dir / "throughput.png", runs),
        plot_latency_cdfs(out_dir / "latency_cdf.png", runs),
        plot_hit_rate(out_dir / "hit_rate.png", runs),
    ]
