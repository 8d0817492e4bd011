"""FleetConfig: `radixserve fleet`, workers on this machine behind sglang-router."""

from __future__ import annotations

from dataclasses import dataclass

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
"""sglang-router's --policy choices that need no extra setup (`manual` needs routing keys)."""


@dataclass
class FleetConfig:
    """`radixserve fleet`: N `radixserve serve` workers on this machine behind sglang-router,
    or P prefill + D decode workers behind it in PD mode. Workers listen on loopback only; the
    router listens on --host (with --api-key, if set)."""

    workers: int = 2
    """Number of data-parallel workers (each a full `radixserve serve`); ignored when
    --prefill-workers / --decode-workers are set."""
    prefill_workers: int = 0
    """Prefill/decode disaggregation: this many prefill workers (prefill worker i serves its
    KV on --disaggregation-bootstrap-port + i), with --decode-workers; the router runs with
    --pd-disaggregation. 0: a data-parallel fleet of --workers."""
    decode_workers: int = 0
    """Prefill/decode disaggregation: this many decode workers, with --prefill-workers."""
    router_port: int = 30000
    """Port the router listens on: the fleet's one public endpoint."""
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

    def __post_init__(self) -> None:
        minimums = {
            "workers": 1,
            "cpu_cores_per_worker": 1,
            "base_gpu_id": 0,
            "prefill_workers": 0,
            "decode_workers": 0,
        }
        for name, minimum in minimums.items():
            if getattr(self, name) < minimum:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= {minimum}; got {getattr(self, name)}")
        if self.policy not in ROUTER_POLICIES:
            allowed = " | ".join(ROUTER_POLICIES)
            raise ValueError(f"--policy must be one of {allowed}; got {self.policy!r}")
        if (self.prefill_workers == 0) != (self.decode_workers == 0):
            raise ValueError(
                "--prefill-workers and --decode-workers go together (both >= 1 for a PD "
                f"fleet); got {self.prefill_workers} and {self.decode_workers}"
            )

    @property
    def pd_disaggregation(self) -> bool:
        """Prefill and decode workers behind the router in PD mode."""
        return self.prefill_workers > 0

    @property
    def num_workers(self) -> int:
        return (
            self.prefill_workers + self.decode_workers if self.pd_disaggregation else self.workers
        )

    def worker_mode(self, index: int) -> str | None:
        """Worker `index`'s --disaggregation-mode: prefill workers first, then decode ones;
        None in a data-parallel fleet."""
        if not self.pd_disaggregation:
            return None
        return "prefill" if index < self.prefill_workers else "decode"
