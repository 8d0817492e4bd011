"""The autoscaling policy: metric samples in, decisions out; no processes, no clock of its own.

    every --scale-interval-s   FleetSample(time, serving workers' queues, num_starting)
        below --min-workers                                  -> up   (at once)
        waiting / serving >= --scale-up-queue-per-worker,
            UP_SAMPLES scrapes in a row, below --max-workers -> up
        a worker with nothing waiting or running for
            --scale-down-idle-s, above --min-workers,
            the rest below the up threshold                 -> down (that worker)
        otherwise, or within --scale-cooldown-s of a change -> hold

Hysteresis: going up needs a queue UP_SAMPLES scrapes long; going down a whole worker idle for
seconds, and never while the others are at the up threshold; either change starts a cool-down
in which nothing else changes. One worker at a time; none while another is still starting.
The same rule is what a cluster's HPA runs on the same metric (docs/api.md, fleet section).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.config import FleetConfig

UP_SAMPLES = 2
"""Consecutive scrapes at the up threshold before a worker is added (one burst of arrivals
between two scrapes does not start a worker)."""


@dataclass(frozen=True)
class WorkerSample:
    """One serving worker's queue, from its /metrics."""

    name: str
    num_waiting: float  # radixserve:num_requests_waiting
    num_running: float  # radixserve:num_requests_running

    @property
    def idle(self) -> bool:
        return self.num_waiting == 0 and self.num_running == 0


@dataclass(frozen=True)
class FleetSample:
    """The fleet at one scrape: its serving workers, and how many are still starting."""

    time: float
    workers: tuple[WorkerSample, ...]
    num_starting: int = 0

    @property
    def num_waiting(self) -> float:
        return sum(w.num_waiting for w in self.workers)


@dataclass(frozen=True)
class Decision:
    """What the policy decided at one sample: `up` (start a worker), `down` (drain
    `worker`) or `hold`; `desired` is the worker count it aims at."""

    time: float
    action: str  # up | down | hold
    desired: int
    reason: str
    worker: str | None = None  # the worker to drain (down)


@dataclass
class ScalingPolicy:
    """Decides from samples when to add or drain a worker (module docstring)."""

    min_workers: int
    max_workers: int
    queue_per_worker: float
    idle_s: float
    cooldown_s: float
    last_change: float | None = None
    num_high: int = 0  # consecutive samples at the up threshold
    idle_since: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: FleetConfig) -> ScalingPolicy:
        return cls(
            min_workers=config.min_workers,
            max_workers=config.max_workers,
            queue_per_worker=config.scale_up_queue_per_worker,
            idle_s=config.scale_down_idle_s,
            cooldown_s=config.scale_cooldown_s,
        )

    def decide(self, sample: FleetSample) -> Decision:
        """The decision for `sample`; an up or down starts the cool-down."""
        self._observe(sample)
        decision = self._decide(sample)
        if decision.action != "hold":
            self.last_change, self.num_high = sample.time, 0
        return decision

    def _observe(self, sample: FleetSample) -> None:
        high = self._queue_per_worker(sample) >= self.queue_per_worker
        self.num_high = self.num_high + 1 if high else 0
        names = {w.name for w in sample.workers}
        for name in list(self.idle_since):
            if name not in names:
                del self.idle_since[name]
        for w in sample.workers:
            if not w.idle:
                self.idle_since.pop(w.name, None)
            else:
                self.idle_since.setdefault(w.name, sample.time)

    def _decide(self, sample: FleetSample) -> Decision:
        current = len(sample.workers) + sample.num_starting
        if current < self.min_workers:
            return Decision(sample.time, "up", current + 1, "below --min-workers")
        if sample.num_starting or self._cooling(sample.time):
            reason = "a worker is starting" if sample.num_starting else "cool-down"
            return Decision(sample.time, "hold", current, reason)
        if self.num_high >= UP_SAMPLES and current < self.max_workers:
            per = self._queue_per_worker(sample)
            reason = f"{per:.1f} waiting per worker >= --scale-up-queue-per-worker"
            return Decision(sample.time, "up", current + 1, reason)
        idle = self._idlest(sample)
        if idle is not None and current > self.min_workers and self.num_high == 0:
            seconds = sample.time - self.idle_since[idle]
            reason = f"{idle} idle {seconds:.0f} s >= --scale-down-idle-s"
            return Decision(sample.time, "down", current - 1, reason, worker=idle)
        return Decision(sample.time, "hold", current, "steady")

    def _cooling(self, now: float) -> bool:
        return self.last_change is not None and now - self.last_change < self.cooldown_s

    def _queue_per_worker(self, sample: FleetSample) -> float:
        return sample.num_waiting / max(len(sample.workers), 1)

    def _idlest(self, sample: FleetSample) -> str | None:
        """The worker idle longest, if that is at least --scale-down-idle-s; ties go to the
        one listed last (the most recently added)."""
        idle = [(since, -i, w.name) for i, w in enumerate(sample.workers)
                if (since := self.idle_since.get(w.name)) is not None]  # fmt: skip
        if not idle:
            return None
        since, _, name = min(idle)
        return name if sample.time - since >= self.idle_s else None
