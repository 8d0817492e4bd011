"""The autoscaling policy: metric samples in, decisions out; no processes, no clock of its own.

    every --scale-interval-s   FleetSample(time, serving workers' queues and first tokens,
                                           num_starting)
        below --min-workers                                        -> up   (at once)  min-workers
        below --max-workers, UP_SAMPLES scrapes in a row with
            waiting / serving >= --scale-up-queue-per-worker       -> up              queue
            or (with --scale-up-ttft-target-s) the share of first
            tokens since the last scrape slower than the target
            >= --scale-up-ttft-slow-fraction (a scrape with no
            first token keeps the last share until all is idle)   -> up              ttft
        a worker with nothing waiting or running for
            --scale-down-idle-s, above --min-workers,
            neither up signal high                                 -> down (that one) idle
        otherwise, within --scale-cooldown-s of a change, or
            (no down) while a serving worker's /metrics did not answer -> hold

The signals are the workers' own metrics: radixserve:num_requests_waiting (the queue),
radixserve:num_requests_running (a worker running anything is not idle) and the growth of the
radixserve:time_to_first_token_seconds histogram between two scrapes (how many first tokens
came, and how many of them after the target: fleet/autoscale_scrape.py `count_over`).
Hysteresis: going up needs a signal high UP_SAMPLES scrapes in a row; going down a whole
worker idle for seconds, and never while a signal is high; either change starts a cool-down
in which nothing else changes. One worker at a time; none while another is still starting.
Every decision names its `rule` (the label of radixserve_fleet:scaling_decisions_total).
The same rule is what a cluster's HPA runs on the same metrics (docs/api.md, fleet section).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.config import FleetConfig

UP_SAMPLES = 2
"""Consecutive scrapes with an up signal high before a worker is added (one burst of
arrivals between two scrapes does not start a worker)."""
UP_RULES = ("min-workers", "queue", "ttft")
DOWN_RULES = ("idle",)


@dataclass(frozen=True)
class WorkerSample:
    """One serving worker's queue, from its /metrics."""

    name: str
    num_waiting: float  # radixserve:num_requests_waiting
    num_running: float  # radixserve:num_requests_running
    num_first_tokens: float = 0.0  # TTFT observations since the previous scrape
    num_slow_first_tokens: float = 0.0  # of those, slower than --scale-up-ttft-target-s

    @property
    def idle(self) -> bool:
        return self.num_waiting == 0 and self.num_running == 0


@dataclass(frozen=True)
class FleetSample:
    """The fleet at one scrape: its serving workers that answered, how many are still
    starting, and how many serving ones did not answer this scrape (a loaded worker's
    /metrics timing out: still counted as workers, their queue unknown)."""

    time: float
    workers: tuple[WorkerSample, ...]
    num_starting: int = 0
    num_unanswered: int = 0

    @property
    def num_waiting(self) -> float:
        return sum(w.num_waiting for w in self.workers)

    @property
    def ttft_slow_fraction(self) -> float | None:
        """The share of first tokens since the last scrape slower than the target; None
        when none came."""
        total = sum(w.num_first_tokens for w in self.workers)
        if total <= 0:
            return None
        return sum(w.num_slow_first_tokens for w in self.workers) / total


@dataclass(frozen=True)
class Decision:
    """What the policy decided at one sample: `up` (start a worker), `down` (drain
    `worker`) or `hold`; `desired` is the worker count it aims at; `rule` the rule that
    decided (UP_RULES, DOWN_RULES; a hold: starting | cool-down | unanswered | steady),
    `reason` the same in words with the numbers."""

    time: float
    action: str  # up | down | hold
    desired: int
    reason: str
    worker: str | None = None  # the worker to drain (down)
    rule: str = "steady"


@dataclass
class ScalingPolicy:
    """Decides from samples when to add or drain a worker (module docstring)."""

    min_workers: int
    max_workers: int
    queue_per_worker: float
    idle_s: float
    cooldown_s: float
    ttft_target_s: float = 0.0  # 0: the TTFT signal is off
    ttft_slow_fraction: float = 0.1
    last_slow_fraction: float = 0.0  # of the last scrape in which first tokens came
    last_change: float | None = None
    num_high: int = 0  # consecutive samples with an up signal high
    idle_since: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: FleetConfig) -> ScalingPolicy:
        return cls(
            min_workers=config.min_workers,
            max_workers=config.max_workers,
            queue_per_worker=config.scale_up_queue_per_worker,
            idle_s=config.scale_down_idle_s,
            cooldown_s=config.scale_cooldown_s,
            ttft_target_s=config.scale_up_ttft_target_s,
            ttft_slow_fraction=config.scale_up_ttft_slow_fraction,
        )

    def decide(self, sample: FleetSample) -> Decision:
        """The decision for `sample`; an up or down starts the cool-down."""
        self._observe(sample)
        decision = self._decide(sample)
        if decision.action != "hold":
            self.last_change, self.num_high = sample.time, 0
        return decision

    def _observe(self, sample: FleetSample) -> None:
        self.num_high = self.num_high + 1 if self._high_signals(sample) else 0
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
        current = len(sample.workers) + sample.num_starting + sample.num_unanswered
        t = sample.time
        if current < self.min_workers:
            return Decision(t, "up", current + 1, "below --min-workers", rule="min-workers")
        if sample.num_starting or self._cooling(t):
            rule = "starting" if sample.num_starting else "cool-down"
            reason = "a worker is starting" if sample.num_starting else "cool-down"
            return Decision(t, "hold", current, reason, rule=rule)
        if self.num_high >= UP_SAMPLES and current < self.max_workers:
            rule, reason = self._high_signals(sample)[0]
            return Decision(t, "up", current + 1, reason, rule=rule)
        if sample.num_unanswered:  # its queue unknown: no worker is drained on a guess
            reason = f"{sample.num_unanswered} serving worker(s) did not answer /metrics"
            return Decision(t, "hold", current, reason, rule="unanswered")
        idle = self._idlest(sample)
        if idle is not None and current > self.min_workers and self.num_high == 0:
            reason = f"{idle} idle {t - self.idle_since[idle]:.0f} s >= --scale-down-idle-s"
            return Decision(t, "down", current - 1, reason, worker=idle, rule="idle")
        return Decision(t, "hold", current, "steady")

    def _high_signals(self, sample: FleetSample) -> list[tuple[str, str]]:
        """The up signals high at `sample`: (rule, reason) each, the queue's first."""
        high = []
        per = self._queue_per_worker(sample)
        if per >= self.queue_per_worker:
            high.append(("queue", f"{per:.1f} waiting per worker >= --scale-up-queue-per-worker"))
        if self._ttft_high(sample):
            reason = (
                f"{self.last_slow_fraction:.0%} of first tokens slower than "
                f"--scale-up-ttft-target-s {self.ttft_target_s:g} >= --scale-up-ttft-slow-fraction"
            )
            high.append(("ttft", reason))
        return high

    def _ttft_high(self, sample: FleetSample) -> bool:
        """The share of slow first tokens at the threshold; a scrape in which no first token
        came keeps the last share while any request runs or waits (long answers take more
        than a scrape interval) or a worker did not answer, and reads low once every worker
        is idle."""
        if self.ttft_target_s <= 0:
            return False
        slow = sample.ttft_slow_fraction
        if slow is not None:
            self.last_slow_fraction = slow
        elif not sample.num_unanswered and all(w.idle for w in sample.workers):
            self.last_slow_fraction = 0.0
        return self.last_slow_fraction >= self.ttft_slow_fraction

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
