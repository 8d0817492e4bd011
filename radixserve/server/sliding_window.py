"""Bounded sliding windows for the dashboard: recent latencies and recent counter snapshots.

Both keep at most `max_samples` entries and drop those older than `window_s` when read, so
memory and the cost of a read are bounded whatever the load.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

WINDOW_S = 60.0
"""The dashboard's "last minute"."""


@dataclass(frozen=True)
class Percentiles:
    count: int
    p50: float | None
    p99: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        return {"count": self.count, "p50": self.p50, "p99": self.p99}


class LatencyWindow:
    """The last `window_s` seconds of one latency's observations (at most `max_samples`)."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        max_samples: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def observe(self, value: float) -> None:
        self._samples.append((self.clock(), value))

    def percentiles(self) -> Percentiles:
        """P50 and P99 by nearest rank; None while the window is empty."""
        self._drop_old()
        values = sorted(v for _, v in self._samples)
        if not values:
            return Percentiles(0, None, None)
        return Percentiles(len(values), _nearest_rank(values, 0.5), _nearest_rank(values, 0.99))

    def _drop_old(self) -> None:
        oldest = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < oldest:
            self._samples.popleft()


def _nearest_rank(sorted_values: list[float], q: float) -> float:
    return sorted_values[max(math.ceil(q * len(sorted_values)) - 1, 0)]


class CounterWindow:
    """Snapshots of monotonic counters, to tell how much each grew over the last window.

    A snapshot is taken when someone asks (the dashboard polls), not on a timer: an unwatched
    server does no work for it. Snapshots closer than `min_gap_s` replace the newest one.
    """

    def __init__(
        self,
        window_s: float = WINDOW_S,
        min_gap_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.window_s = window_s
        self.min_gap_s = min_gap_s
        self.clock = clock
        self._snapshots: deque[tuple[float, dict[str, float]]] = deque(
            maxlen=math.ceil(window_s / min_gap_s) + 2
        )

    def record(self, counters: Mapping[str, float]) -> None:
        now = self.clock()
        if len(self._snapshots) > 1 and now - self._snapshots[-1][0] < self.min_gap_s:
            self._snapshots.pop()
        self._snapshots.append((now, dict(counters)))
        while now - self._snapshots[1 if len(self._snapshots) > 1 else 0][0] >= self.window_s:
            self._snapshots.popleft()  # keep one snapshot at or before the window's start

    def growth(self) -> tuple[float, dict[str, float]] | None:
        """(seconds covered, growth per counter) from the oldest snapshot in the window to
        the newest; None until two snapshots exist."""
        if len(self._snapshots) < 2:
            return None
        (t0, first), (t1, last) = self._snapshots[0], self._snapshots[-1]
        return t1 - t0, {key: last[key] - first.get(key, 0) for key in last}
