"""Reading a worker's /metrics: its queue, hit rate and TTFT histogram; from the histogram's
growth (the buckets are cumulative since start) the P99 TTFT of the last TTFT_WINDOW_S, and
how many first tokens came since the previous scrape and how many of them after a target."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

WAITING = "radixserve:num_requests_waiting"
RUNNING = "radixserve:num_requests_running"
HIT_RATE = "radixserve:cache_hit_rate"
TTFT = "radixserve:time_to_first_token_seconds"
TTFT_WINDOW_S = 60.0
"""The dashboard's P99 TTFT covers the requests whose first token came this recently."""


@dataclass(frozen=True)
class WorkerMetrics:
    """What the fleet reads from one scrape of a worker."""

    num_waiting: float
    num_running: float
    hit_rate: float
    ttft_buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), sorted


def parse_worker_metrics(text: str) -> WorkerMetrics:
    """The fields of WorkerMetrics from a worker's Prometheus text; absent ones are 0."""
    gauges: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == TTFT + "_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name in (WAITING, RUNNING, HIT_RATE):
                gauges[s.name] = s.value
    return WorkerMetrics(
        num_waiting=gauges.get(WAITING, 0.0),
        num_running=gauges.get(RUNNING, 0.0),
        hit_rate=gauges.get(HIT_RATE, 0.0),
        ttft_buckets=tuple(sorted(buckets)),
    )


def histogram_quantile(buckets: tuple[tuple[float, float], ...], q: float) -> float | None:
    """Prometheus's histogram_quantile: linear inside the bucket holding the q-th
    observation; the largest finite bound when it falls in +Inf; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            inside = count - lower_count
            share = (rank - lower_count) / inside if inside else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def count_over(buckets: tuple[tuple[float, float], ...], target_s: float) -> float:
    """Observations above `target_s` in cumulative `buckets` (sorted, +Inf last): those up
    to it are interpolated linearly inside the bucket that holds it, as histogram_quantile
    reads a bucket; past the largest finite bound every observation in +Inf counts."""
    if not buckets:
        return 0.0
    total = buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if math.isinf(bound):
            break
        if target_s <= bound:
            share = (target_s - lower_bound) / (bound - lower_bound) if bound > lower_bound else 1
            return total - (lower_count + (count - lower_count) * share)
        lower_bound, lower_count = bound, count
    return total - lower_count


def grown(
    old: tuple[tuple[float, float], ...], new: tuple[tuple[float, float], ...]
) -> tuple[tuple[float, float], ...]:
    """The observations in `new` that `old` (an earlier scrape of the same histogram) lacks."""
    before = dict(old)
    return tuple((bound, count - before.get(bound, 0.0)) for bound, count in new)


class TTFTWindow:
    """One worker's TTFT histograms over the last TTFT_WINDOW_S; p99 of their difference."""

    def __init__(self, window_s: float = TTFT_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, tuple[tuple[float, float], ...]]] = deque()

    def add(self, now: float, buckets: tuple[tuple[float, float], ...]) -> None:
        self.samples.append((now, buckets))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def p99(self) -> float | None:
        """P99 TTFT (s) of the requests seen between the oldest and newest sample."""
        if len(self.samples) < 2:
            return None
        return histogram_quantile(grown(self.samples[0][1], self.samples[-1][1]), 0.99)

    def since_last(self, target_s: float | None) -> tuple[float, float]:
        """(first tokens, of them slower than `target_s`; 0 without a target) between the
        two newest samples; (0, 0) before the second one."""
        if len(self.samples) < 2:
            return 0.0, 0.0
        last = grown(self.samples[-2][1], self.samples[-1][1])
        num_slow = count_over(last, target_s) if target_s else 0.0
        return (last[-1][1] if last else 0.0), num_slow
