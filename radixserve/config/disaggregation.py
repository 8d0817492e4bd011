"""DisaggregationConfig: prefill/decode disaggregation, SGLang's protocol and flags."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.config.server import check_host

if TYPE_CHECKING:
    from radixserve.config.scheduler import SchedulerConfig

DISAGGREGATION_MODES = ("null", "prefill", "decode")  # SGLang's --disaggregation-mode
TRANSFER_BACKENDS = ("tcp", "fake")
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default


def is_loopback_host(host: str) -> bool:
    """Whether `host` (an address, or "localhost") names this machine's loopback only; an
    IPv4 address mapped into IPv6 (`::ffff:127.0.0.1`, what a dual-stack socket reports for an
    IPv4 peer) as its IPv4 address."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


@dataclass
class DisaggregationConfig:
    """Prefill/decode disaggregation (SGLang's protocol): sglang-router in PD mode sends each
    request to a prefill and a decode worker with bootstrap_host / _port / _room."""

    disaggregation_mode: str = "null"
    """null (a normal worker) | prefill (computes the prompt, returns after one token and
    serves its KV pages on the bootstrap port) | decode (pulls the prompt's KV pages from the
    prefill worker, then decodes)."""
    disaggregation_bootstrap_port: int = SGLANG_BOOTSTRAP_PORT
    """prefill: the port decode workers pull KV pages from (0: a free one). `fleet`: prefill
    worker i serves on this port + i (0 refused: the router must be told each port)."""
    disaggregation_bootstrap_host: str = "127.0.0.1"
    """prefill: the address the bootstrap port binds; loopback unless told otherwise (as
    --host): decode workers on other machines need a reachable one, and then a
    --disaggregation-secret-file."""
    disaggregation_transfer_backend: str = "tcp"
    """tcp (pages over TCP, each MACed) | fake (moves nothing: the decode worker computes
    the prompt itself; warm-up and tests)."""
    disaggregation_secret_file: str | None = None
    """A file (mode 0600, >= 16 bytes) holding the secret shared by a fleet's prefill and
    decode workers: both sides of every KV transfer prove they hold it and every page is
    MACed with it. Without it a prefill worker binds loopback only and a decode worker fetches
    from loopback peers only. `fleet` makes one per fleet."""
    disaggregation_room_budget_mb: int = 0
    """prefill: MiB of published KV pages waiting for their decode workers at most (the
    oldest rooms are dropped to fit); 0: the KV pool's size, at most 4096."""
    disaggregation_transfer_timeout: float = 30.0
    """Seconds a decode worker waits for a room's KV pages (and a prefill worker keeps a
    request for them waiting) before the request fails with an error naming the room."""

    @property
    def mode(self) -> str | None:
        """prefill | decode, or None for a normal worker."""
        return None if self.disaggregation_mode == "null" else self.disaggregation_mode

    def verify(self, scheduler: SchedulerConfig, tp_size: int) -> None:
        """Rejects unknown values and combinations disaggregation cannot serve, naming flags."""
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            allowed = " | ".join(DISAGGREGATION_MODES)
            raise ValueError(
                f"--disaggregation-mode must be {allowed}; got {self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                "--disaggregation-transfer-backend must be tcp | fake; "
                f"got {self.disaggregation_transfer_backend!r}"
            )
        check_host(self.disaggregation_bootstrap_host, "--disaggregation-bootstrap-host")
        if not 0 <= self.disaggregation_bootstrap_port < 65536:
            raise ValueError(
                "--disaggregation-bootstrap-port must be in [0, 65535]; "
                f"got {self.disaggregation_bootstrap_port}"
            )
        if not self.disaggregation_transfer_timeout > 0:
            raise ValueError(
                "--disaggregation-transfer-timeout must be > 0; "
                f"got {self.disaggregation_transfer_timeout}"
            )
        if self.disaggregation_room_budget_mb < 0:
            raise ValueError(
                "--disaggregation-room-budget-mb must be >= 0; "
                f"got {self.disaggregation_room_budget_mb}"
            )
        if self.mode is not None:
            self._verify_combination(scheduler, tp_size)

    def _verify_combination(self, scheduler: SchedulerConfig, tp_size: int) -> None:
        mode = f"--disaggregation-mode {self.disaggregation_mode}"
        if self.mode == "decode" and scheduler.disable_radix_cache:
            message = "inserts the received KV into the radix tree: drop --disable-radix-cache"
            raise ValueError(f"{mode} {message}")
        host = self.disaggregation_bootstrap_host
        if self.mode == "prefill" and not self.disaggregation_secret_file:
            if not is_loopback_host(host):
                raise ValueError(
                    f"{mode} --disaggregation-bootstrap-host {host} serves KV beyond loopback: "
                    "give every prefill and decode worker --disaggregation-secret-file"
                )
        if tp_size > 1:
            raise ValueError(f"{mode} moves whole KV pages of one rank: use --tp-size 1")
