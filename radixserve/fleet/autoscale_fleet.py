"""The autoscaled fleet: --max-workers worker slots, --min-workers of them running at first,
the policy (fleet/autoscale.py) fed a scrape of every serving worker each --scale-interval-s.

    slot:  stopped --start--> starting --/health 200--> serving --SIGTERM--> draining
              ^                                                                   |
              +------------------------------ exit -------------------------------+
    up:    the first stopped slot starts with --router-url: it joins the router by itself
    down:  SIGTERM to the chosen worker: it leaves the router, then finishes what it runs
           (server/drain.py), so no request is lost

Every decision is printed on the fleet's output and kept (bounded) for its port (fleet_view.py).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import FleetConfig, ServerConfig
from radixserve.fleet.autoscale import Decision, FleetSample, ScalingPolicy, WorkerSample
from radixserve.fleet.autoscale_scrape import TTFTWindow, WorkerMetrics, parse_worker_metrics
from radixserve.fleet.fleet_view import FleetView
from radixserve.fleet.launch import STOP_MARGIN_S, Child, stop_all, wait_until
from radixserve.fleet.probes import http_get, router_live, router_ready
from radixserve.fleet.worker_template import OrphanReaper

logger = logging.getLogger(__name__)
DECISION_HISTORY = 200
"""Scaling decisions (ups and downs) the fleet port shows."""
TIMELINE_POINTS = 600
"""Scrapes (time, serving workers, waiting requests) the fleet port's chart shows."""
STATES = ("stopped", "starting", "serving", "draining")


@dataclass
class WorkerSlot:
    """One worker of the fleet, running or not, with what its last scrape said."""

    child: Child
    state: str = "stopped"
    since: float = 0.0
    metrics: WorkerMetrics | None = None
    ttft: TTFTWindow = field(default_factory=TTFTWindow)

    def move(self, state: str, now: float) -> None:
        self.state, self.since = state, now

    def view(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "name": self.child.name,
            "url": self.child.url,
            "state": self.state,
            "num_waiting": None if m is None else m.num_waiting,
            "num_running": None if m is None else m.num_running,
            "hit_rate": None if m is None else m.hit_rate,
            "p99_ttft_s": self.ttft.p99(),
        }


class FleetState:
    """The slots, the decisions taken and a timeline; read by the fleet port's thread."""

    def __init__(self, workers: list[Child], desired: int, ttft_target_s: float = 0.0) -> None:
        self.slots = [WorkerSlot(child) for child in workers]
        self.ttft_target_s = ttft_target_s  # first tokens slower than this count as slow
        self.desired = desired
        self.decisions: deque[Decision] = deque(maxlen=DECISION_HISTORY)
        self.timeline: deque[tuple[float, int, float]] = deque(maxlen=TIMELINE_POINTS)
        self.num_decisions: Counter[tuple[str, str]] = Counter()  # (action, rule)
        self.last: Decision | None = None
        self.ttft_slow_fraction: float | None = None
        self.lock = threading.Lock()

    def in_state(self, state: str) -> list[WorkerSlot]:
        return [s for s in self.slots if s.state == state]

    def scrape(self, now: float) -> FleetSample:
        """Reads every serving worker's /metrics; one that does not answer counts as a
        worker whose queue is unknown (FleetSample.num_unanswered)."""
        workers, unanswered = [], 0
        for slot in self.in_state("serving"):
            body = http_get(slot.child.url + "/metrics")
            if body is None:
                unanswered += 1
                continue
            metrics = parse_worker_metrics(body.decode())
            with self.lock:
                slot.metrics = metrics
                slot.ttft.add(now, metrics.ttft_buckets)
            first, slow = slot.ttft.since_last(self.ttft_target_s or None)
            name = slot.child.name
            workers.append(
                WorkerSample(name, metrics.num_waiting, metrics.num_running, first, slow)
            )
        sample = FleetSample(now, tuple(workers), len(self.in_state("starting")), unanswered)
        with self.lock:
            self.timeline.append((now, len(workers) + unanswered, sample.num_waiting))
            self.ttft_slow_fraction = sample.ttft_slow_fraction
        return sample

    def record(self, decision: Decision) -> None:
        with self.lock:
            self.desired, self.last = decision.desired, decision
            if decision.action != "hold":
                self.decisions.append(decision)
                self.num_decisions[decision.action, decision.rule] += 1

    def snapshot(self) -> dict[str, Any]:
        """What the fleet port serves: workers side by side, decisions, timeline."""
        with self.lock:
            return {
                "desired_workers": self.desired,
                "workers": [s.view() for s in self.slots],
                "num_workers": {state: len(self.in_state(state)) for state in STATES},
                "num_decisions": {f"{a}/{r}": n for (a, r), n in self.num_decisions.items()},
                "last_decision": None if self.last is None else vars(self.last),
                "ttft_target_s": self.ttft_target_s or None,
                "ttft_slow_fraction": self.ttft_slow_fraction,
                "decisions": [vars(d) for d in self.decisions],
                "timeline": list(self.timeline),
            }


class Autoscaler:
    """Runs the fleet: slot transitions, the policy each interval, and acting on it."""

    def __init__(
        self,
        config: FleetConfig,
        state: FleetState,
        router: Child,
        stop_timeout_s: float,
        reaper: OrphanReaper | None = None,
    ) -> None:
        self.config = config
        self.reaper = reaper  # the workers' orphaned descendants (worker_template.py)
        self.state = state
        self.router = router
        self.stop_timeout_s = stop_timeout_s  # a drained worker still running then is killed
        self.policy = ScalingPolicy.from_config(config)

    def start(self, stop: threading.Event) -> bool:
        """Starts --min-workers workers and waits until the router counts them healthy;
        False (logged) when one fails first or a stop signal comes."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        for slot in self.state.slots[: self.config.min_workers]:
            self._start(slot, time.monotonic())
        ready = lambda: router_ready(self.router.url, self.config.min_workers)  # noqa: E731
        for slot in self.state.in_state("starting"):
            if not wait_until(slot.child, ready, deadline, stop):
                return False
        self.refresh(time.monotonic())
        return True

    def run(self, stop: threading.Event) -> int:
        """Until a stop signal (0) or the router's exit (1)."""
        while not stop.wait(self.config.scale_interval_s):
            if not self.router.alive:
                code = self.router.proc.returncode
                logger.error("the router exited with code %s; stopping", code)
                return 1
            now = time.monotonic()
            self.refresh(now)
            if self.reaper is not None:
                self.reaper.tick(now)
            decision = self.policy.decide(self.state.scrape(now))
            self.state.record(decision)
            self.act(decision, now)
        return 0

    def refresh(self, now: float) -> None:
        """Moves slots along: started and healthy -> serving; exited -> stopped."""
        with self.state.lock:
            for slot in self.state.slots:
                self._refresh(slot, now)

    def _refresh(self, slot: WorkerSlot, now: float) -> None:
        child = slot.child
        if slot.state == "starting" and not child.alive:
            logger.error("%s exited with code %s while starting", child.name, child.proc.returncode)
            slot.move("stopped", now)
        elif slot.state == "starting" and http_get(child.url + "/health") is not None:
            slot.move("serving", now)
        elif slot.state == "starting" and now - slot.since > self.config.startup_timeout_s:
            logger.error("%s not healthy after --startup-timeout-s; killing it", child.name)
            child.proc.kill()
            slot.move("stopped", now)
        elif slot.state == "draining" and child.alive and now - slot.since > self.stop_timeout_s:
            logger.error("%s still draining after %.0f s; killing it", child.name, now - slot.since)
            child.proc.kill()
        elif slot.state in ("serving", "draining") and not child.alive:
            if slot.state == "serving":
                logger.error("%s exited with code %s", child.name, child.proc.returncode)
            slot.move("stopped", now)
            slot.metrics = None

    def act(self, decision: Decision, now: float) -> None:
        if decision.action == "hold":
            logger.debug("hold at %d workers (%s)", decision.desired, decision.reason)
            return
        print(f"radixserve fleet: scale {decision.action} to {decision.desired} workers "
              f"[{decision.rule}] ({decision.reason})", flush=True)  # fmt: skip
        if decision.action == "up":
            stopped = self.state.in_state("stopped")
            if stopped:
                with self.state.lock:
                    self._start(stopped[0], now)
            return
        for slot in self.state.in_state("serving"):
            if slot.child.name == decision.worker:
                slot.child.proc.send_signal(signal.SIGTERM)
                with self.state.lock:
                    slot.move("draining", now)

    def _start(self, slot: WorkerSlot, now: float) -> None:
        slot.child.start()
        slot.move("starting", now)
        slot.ttft = TTFTWindow()


def autoscaled_children(workers: list[Child], router: Child) -> list[Child]:
    """`workers` joining `router` by themselves (serve --router-url): the fleet only starts
    and stops them, and a drained one leaves the router before it stops."""
    for worker in workers:
        worker.command = [*worker.command, "--router-url", router.url]
    return workers


def run_autoscaled(
    config: FleetConfig,
    workers: list[Child],
    router: Child,
    stop: threading.Event,
    server: ServerConfig,
    reaper: OrphanReaper | None = None,
) -> int:
    """The router first (it answers with no worker), then --min-workers workers, then the
    autoscaler (and the fleet port, keyed with --api-key, if --fleet-port) until a stop
    signal; the workers are stopped (drained) before the caller stops the router."""
    children = autoscaled_children(workers, router)
    state = FleetState(children, config.min_workers, config.scale_up_ttft_target_s)
    drain_timeout_s = server.drain_timeout + STOP_MARGIN_S
    autoscaler = Autoscaler(config, state, router, drain_timeout_s, reaper)
    deadline = time.monotonic() + config.startup_timeout_s
    router.start()
    if not wait_until(router, lambda: router_live(router.url), deadline, stop):
        return 0 if stop.is_set() else 1
    if not autoscaler.start(stop):
        return 0 if stop.is_set() else 1
    view = None
    if config.fleet_port:
        view = FleetView.start(state, config.fleet_host, config.fleet_port, server.api_key)
    try:
        print(f"radixserve fleet ready at {router.url} ({config.min_workers} to "
              f"{config.max_workers} workers, policy {config.policy})", flush=True)  # fmt: skip
        return autoscaler.run(stop)
    finally:
        stop_all(workers, timeout_s=drain_timeout_s)  # they leave the router while it runs
        if view is not None:
            view.stop()
