"""Serving metrics from per-request timings, named like `vllm bench serve` and SGLang's
`bench_serving`: throughputs, TTFT / TPOT / ITL / E2EL percentiles, concurrency, cache hits.

TPOT excludes the first token: (e2e - ttft) / (output_len - 1), over requests with more than
one output token. ITL is the gap between streamed chunks; a chunk carrying n tokens counts as
n gaps of gap / n (SGLang's convention). Latencies are reported in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixserve_bench.hit_rate import max_hit_rate
from radixserve_bench.record import RequestResult

PERCENTILES = (50, 90, 99)


def latency_stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    """mean / median / std / p90 / p99 of `values_s` (seconds) as `<stat>_<name>_ms`."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    stats = {f"mean_{name}_ms": ms.mean(), f"std_{name}_ms": ms.std()}
    for p in PERCENTILES:
        key = f"median_{name}_ms" if p == 50 else f"p{p}_{name}_ms"
        stats[key] = np.percentile(ms, p)
    return {k: float(v) for k, v in stats.items()}


def request_itls(result: RequestResult) -> list[float]:
    """Inter-token latencies of one request, in seconds."""
    itls: list[float] = []
    times, tokens = result.chunk_times, result.chunk_tokens
    for prev, now, num in zip(times, times[1:], tokens[1:]):
        itls += [(now - prev) / num] * num
    return itls


def request_tpot(result: RequestResult) -> float | None:
    """Time per output token after the first, or None for a single-token output."""
    if result.output_len <= 1 or result.ttft is None:
        return None
    return (result.e2e - result.ttft) / (result.output_len - 1)


def peak_output_throughput(results: Sequence[RequestResult]) -> float:
    """Most output tokens that arrived within one wall-clock second (vLLM's peak)."""
    times = [r.start_time + t for r in results for t in r.chunk_times]
    weights = [n for r in results for n in r.chunk_tokens]
    if not times:
        return 0.0
    return float(np.bincount(np.floor(times).astype(int), weights=weights).max())


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once."""
    events = sorted(
        [(r.start_time, 1) for r in results] + [(r.start_time + r.e2e, -1) for r in results],
        key=lambda e: (e[0], e[1]),
    )
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def throughput_metrics(ok: Sequence[RequestResult], duration: float) -> dict[str, float]:
    num_in = sum(r.prompt_len for r in ok)
    num_out = sum(r.output_len for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    return {
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(ok) * per_s,
        "input_throughput": num_in * per_s,
        "output_throughput": num_out * per_s,
        "total_token_throughput": (num_in + num_out) * per_s,
        "max_output_tokens_per_s": peak_output_throughput(ok),
        "max_concurrent_requests": peak_concurrency(ok),
        "concurrency": sum(r.e2e for r in ok) * per_s,
    }


def latency_metrics(ok: Sequence[RequestResult]) -> dict[str, float]:
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    followup = [r.ttft for r in ok if r.ttft is not None and r.turn > 0]
    tpots = [t for r in ok if (t := request_tpot(r)) is not None]
    itls = [itl for r in ok for itl in request_itls(r)]
    stats = latency_stats("ttft", ttfts) | latency_stats("tpot", tpots)
    stats |= latency_stats("itl", itls) | latency_stats("e2el", [r.e2e for r in ok])
    if followup:  # later turns of a conversation: what the prefix cache should make fast
        stats |= latency_stats("ttft_followup", followup)
    return stats


def cache_metrics(ok: Sequence[RequestResult], page_size: int) -> dict[str, float]:
    """Measured hit rate (server-reported cached tokens) against the workload's optimum."""
    ordered = sorted(ok, key=lambda r: r.index)
    num_in = sum(r.prompt_len for r in ok)
    num_cached = sum(r.cached_tokens for r in ok)
    optimum = max_hit_rate([r.prompt_ids for r in ordered], page_size,
                           [r.output_ids for r in ordered])  # fmt: skip
    rate = num_cached / num_in if num_in else 0.0
    return {
        "total_cached_tokens": num_cached,
        "cache_hit_rate": rate,
        "max_cache_hit_rate": optimum,
        "cache_hit_rate_of_max": rate / optimum if optimum else 0.0,
        "page_size": page_size,
    }


def compute_metrics(
    results: Sequence[RequestResult], duration: float, page_size: int
) -> dict[str, float]:
    """Every metric of one run; failed requests are only counted."""
    ok = [r for r in results if r.success]
    counts = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration}
    return (
        counts
        | throughput_metrics(ok, duration)
        | latency_metrics(ok)
        | cache_metrics(ok, page_size)
    )


ENGINE_COUNTERS = (
    "num_requests", "prompt_tokens", "cached_tokens", "prefill_tokens_computed",
    "decode_tokens", "evicted_pages", "retractions", "forward_steps",
)  # fmt: skip


def engine_counter_delta(before: dict, after: dict) -> dict[str, int]:
    """How much each radixserve engine counter (`get_stats()`) grew during the run."""
    return {k: after[k] - before.get(k, 0) for k in ENGINE_COUNTERS if k in after}
