"""FleetConfig: `radixserve fleet`, workers on this machine behind sglang-router."""

from __future__ import annotations

import math
import shlex
import threading
from dataclasses import dataclass

from radixserve.config.field_types import flag_of
from radixserve.config.server import MAX_PORT, check_host

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
"""sglang-router's --policy choices (`manual` needs routing keys; power_of_two, workers on the
router's command line: a PD fleet's, see FleetConfig._check_power_of_two)."""
DEFAULT_WORKERS = 2
"""A fixed fleet's size when --workers is not given."""


@dataclass
class FleetConfig:
    """`radixserve fleet`: N `radixserve serve` workers on this machine behind sglang-router,
    or P prefill + D decode workers behind it in PD mode. Workers listen on loopback only; the
    router listens on --host (with --api-key, if set)."""

    workers: int | None = None
    """Number of data-parallel workers (each a full `radixserve serve`), a fixed fleet
    (unset: 2, DEFAULT_WORKERS); ignored when --prefill-workers / --decode-workers are set; not
    with --min-workers / --max-workers."""
    min_workers: int = 0
    """Autoscaling (with --max-workers, instead of --workers): never fewer workers than this
    (>= 1); the fleet starts with this many. 0: a fixed fleet."""
    max_workers: int = 0
    """Autoscaling (with --min-workers): never more workers than this. 0: a fixed fleet."""
    scale_up_queue_per_worker: float = 4.0
    """Autoscaling: a worker is added when the waiting requests
    (radixserve:num_requests_waiting, summed) per serving worker reach this, two scrapes in
    a row."""
    scale_up_ttft_target_s: float = 0.0
    """Autoscaling: a time-to-first-token target (s). A worker is also added when, of the
    requests that got their first token since the last scrape (the growth of the workers'
    radixserve:time_to_first_token_seconds histogram buckets), the share slower than this
    reaches --scale-up-ttft-slow-fraction, two scrapes in a row. 0: the queue alone."""
    scale_up_ttft_slow_fraction: float = 0.1
    """Autoscaling with --scale-up-ttft-target-s: the share of first tokens over the target
    (0 < f <= 1) at which a worker is added."""
    scale_down_idle_s: float = 60.0
    """Autoscaling: a worker with nothing waiting or running for this long is drained
    (SIGTERM: it leaves the router, finishes what it runs, exits)."""
    scale_interval_s: float = 2.0
    """Autoscaling: seconds between scrapes of every worker's /metrics."""
    scale_cooldown_s: float = 10.0
    """Autoscaling: after a worker is added or drained, no other change for this long."""
    fleet_port: int = 0
    """The fleet's own port: GET /metrics (Prometheus: workers, scaling decisions) and a
    dashboard of the workers side by side at /; keyed with --api-key if set. 0: none."""
    fleet_host: str = "127.0.0.1"
    """Where --fleet-port listens (loopback by default)."""
    prefill_workers: int = 0
    """Prefill/decode disaggregation: this many prefill workers (prefill worker i serves its
    KV on --disaggregation-bootstrap-port + i), with --decode-workers; the router runs with
    --pd-disaggregation. 0: a data-parallel fleet of --workers."""
    decode_workers: int = 0
    """Prefill/decode disaggregation: this many decode workers, with --prefill-workers."""
    router_port: int = 30000
    """Port the router listens on: the fleet's one public endpoint."""
    router_prometheus_port: int = 29000
    """Port the router serves its Prometheus metrics on (on --host; sglang-router's default):
    a second fleet on the machine needs another."""
    worker_base_port: int = 31000
    """Worker i listens on 127.0.0.1:(worker_base_port + i)."""
    policy: str = "cache_aware"
    """Router policy: cache_aware | round_robin | random | power_of_two."""
    base_gpu_id: int = 0
    """On CUDA: worker i runs on GPU base_gpu_id + i (CUDA_VISIBLE_DEVICES)."""
    cpu_cores_per_worker: int = 1
    """On CPU: worker i is pinned to its own cores (taken in order from this process's
    affinity, wrapping around when there are too few) and runs that many torch threads."""
    router_args: str = ""
    """Extra sglang-router flags, one shell-quoted string, e.g. "--cb-failure-threshold 2
    --health-check-interval-secs 2" for fast failover."""
    startup_timeout_s: float = 600.0
    """Seconds to wait for every worker, then the router, to get healthy."""
    worker_template: bool = True
    """CPU fleets on Linux: start every worker by fork from one process that has imported
    torch, transformers and radixserve once (fleet/worker_template.py), so that a new worker
    (an autoscaled one too) only loads its model; --no-worker-template: each worker a fresh
    `radixserve serve` (seconds of imports each)."""

    def __post_init__(self) -> None:
        minimums = {
            "workers": 1,
            "min_workers": 0,
            "max_workers": 0,
            "fleet_port": 0,
            "cpu_cores_per_worker": 1,
            "base_gpu_id": 0,
            "prefill_workers": 0,
            "decode_workers": 0,
        }
        for name, minimum in minimums.items():
            if getattr(self, name) is not None and getattr(self, name) < minimum:
                flag = flag_of(name)
                raise ValueError(f"{flag} must be >= {minimum}; got {getattr(self, name)}")
        ports = (("router_port", 1), ("router_prometheus_port", 1), ("worker_base_port", 1),
                 ("fleet_port", 0))  # fmt: skip
        for name, low in ports:
            if not low <= getattr(self, name) <= MAX_PORT:
                flag = flag_of(name)
                raise ValueError(
                    f"{flag} must be in [{low}, {MAX_PORT}]; got {getattr(self, name)}"
                )
        check_host(self.fleet_host, "--fleet-host")
        try:
            shlex.split(self.router_args)
        except ValueError as exc:
            raise ValueError(f"--router-args must be shell-quoted flags: {exc}") from None
        self._check_times()
        if self.policy not in ROUTER_POLICIES:
            allowed = " | ".join(ROUTER_POLICIES)
            raise ValueError(f"--policy must be one of {allowed}; got {self.policy!r}")
        self._check_power_of_two()
        if (self.prefill_workers == 0) != (self.decode_workers == 0):
            raise ValueError(
                "--prefill-workers and --decode-workers go together (both >= 1 for a PD "
                f"fleet); got {self.prefill_workers} and {self.decode_workers}"
            )
        if self.min_workers or self.max_workers:
            self._check_autoscale()
        if self.fleet_port and not self.autoscale:
            raise ValueError(
                "--fleet-port is served by an autoscaled fleet: give --min-workers / "
                "--max-workers (both N: a fleet of N with its port)"
            )
        last = self.worker_base_port + self.num_workers - 1
        if last > MAX_PORT:
            raise ValueError(
                f"--worker-base-port {self.worker_base_port} + {self.num_workers} workers "
                f"passes port {MAX_PORT}; lower it"
            )

    def _check_power_of_two(self) -> None:
        """sglang-router (0.3) refuses power_of_two unless its workers are on its command line
        at start, two of each kind at least: a PD fleet's are; a data-parallel fleet's join it
        once it runs (with their key), so the router would exit at once."""
        if self.policy != "power_of_two":
            return
        if not self.pd_disaggregation:
            raise ValueError(
                "--policy power_of_two needs the workers on sglang-router's command line at "
                "start, and a data-parallel fleet's join it afterwards: use cache_aware, "
                "round_robin or random (or run sglang-router yourself with --worker-urls)"
            )
        if min(self.prefill_workers, self.decode_workers) < 2:
            raise ValueError(
                "--policy power_of_two needs at least 2 prefill and 2 decode workers; got "
                f"{self.prefill_workers} and {self.decode_workers}"
            )

    def _check_autoscale(self) -> None:
        """--min-workers / --max-workers: both, 1 <= min <= max, not with --workers nor PD."""
        if self.workers is not None:
            raise ValueError(
                "--workers is a fixed fleet; --min-workers / --max-workers an autoscaled one: "
                "give one or the other"
            )
        if self.pd_disaggregation:
            raise ValueError(
                "--min-workers / --max-workers do not scale a PD fleet (--prefill-workers / "
                "--decode-workers are fixed: the router is told its PD workers at start)"
            )
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                "--min-workers must be >= 1 and <= --max-workers; got "
                f"{self.min_workers} and {self.max_workers}"
            )

    def _check_times(self) -> None:
        """The timing and scaling flags, finite and in range (the autoscaling ones checked for
        a fixed fleet too: an out-of-range value is refused, not ignored)."""
        for name, low in (
            ("startup_timeout_s", 0),
            ("scale_up_queue_per_worker", 0),
            ("scale_interval_s", 0),
            ("scale_down_idle_s", 0),
        ):
            if not low < getattr(self, name) < math.inf:
                flag = flag_of(name)
                raise ValueError(f"{flag} must be a number > 0; got {getattr(self, name)}")
        if self.scale_interval_s > threading.TIMEOUT_MAX:  # the autoscaler's Event.wait
            raise ValueError(f"--scale-interval-s must be at most {threading.TIMEOUT_MAX:.0f}")
        if not 0 <= self.scale_cooldown_s < math.inf:
            raise ValueError(f"--scale-cooldown-s must be >= 0; got {self.scale_cooldown_s}")
        if not 0 <= self.scale_up_ttft_target_s < math.inf:
            raise ValueError(
                f"--scale-up-ttft-target-s must be >= 0 (0: off); got {self.scale_up_ttft_target_s}"
            )
        if not 0 < self.scale_up_ttft_slow_fraction <= 1:
            raise ValueError(
                "--scale-up-ttft-slow-fraction must be > 0 and <= 1; got "
                f"{self.scale_up_ttft_slow_fraction}"
            )

    @property
    def autoscale(self) -> bool:
        """Workers between --min-workers and --max-workers, following the queue."""
        return self.max_workers > 0

    @property
    def pd_disaggregation(self) -> bool:
        """Prefill and decode workers behind the router in PD mode."""
        return self.prefill_workers > 0

    @property
    def num_workers(self) -> int:
        """Worker slots: ports, cores / GPUs and command lines are made for this many (an
        autoscaled fleet's --max-workers, of which --min-workers run at first)."""
        if self.pd_disaggregation:
            return self.prefill_workers + self.decode_workers
        if self.autoscale:
            return self.max_workers
        return DEFAULT_WORKERS if self.workers is None else self.workers

    def worker_mode(self, index: int) -> str | None:
        """Worker `index`'s --disaggregation-mode: prefill workers first, then decode ones;
        None in a data-parallel fleet."""
        if not self.pd_disaggregation:
            return None
        return "prefill" if index < self.prefill_workers else "decode"
