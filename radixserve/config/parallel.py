"""ParallelConfig: tensor parallelism's rank count and torch.distributed setup."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import torch

DIST_BACKENDS = ("auto", "nccl", "gloo")
DEFAULT_INIT_ADDR = "127.0.0.1:0"  # loopback, a port the kernel picks


@dataclass
class ParallelConfig:
    """Tensor parallelism: how many ranks share the model, and how they talk."""

    tp_size: int = 1
    """Tensor-parallel ranks (processes, one device each); rank 0 runs the scheduler and the
    radix cache, every rank holds 1/tp of the attention heads, MLP and vocabulary."""
    dist_backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU) | nccl | gloo: the torch.distributed backend of
    --tp-size > 1."""
    dist_init_addr: str | None = None
    """host:port where the ranks rendezvous: rank 0 listens on that address only (torch's
    TCPStore, no authentication), and gloo / nccl use the interface towards it
    (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unless set); port 0: any free one. Default:
    127.0.0.1:0 (loopback). A wildcard host is refused. For multi-node later: an address
    every node reaches, on a network only the ranks share."""
    dist_timeout: float = 300.0
    """Seconds a collective (or the rendezvous) may wait for the other ranks before the engine
    stops with an error, and the start-up bound: a rank not ready by then fails the start,
    named with its last output; a rank that exits is noticed sooner."""

    def verify(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1; got {self.tp_size}")
        if self.dist_backend not in DIST_BACKENDS:
            allowed = ", ".join(DIST_BACKENDS)
            raise ValueError(f"--dist-backend must be one of {allowed}; got {self.dist_backend!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout must be > 0; got {self.dist_timeout}")
        if self.dist_init_addr is not None:
            split_init_addr(self.dist_init_addr)

    def torch_backend(self, device: torch.device) -> str:
        """The backend `auto` means on `device`; nccl only on CUDA."""
        if self.dist_backend == "auto":
            return "nccl" if device.type == "cuda" else "gloo"
        if self.dist_backend == "nccl" and device.type != "cuda":
            raise ValueError(f"--dist-backend nccl needs CUDA; the model runs on {device}")
        return self.dist_backend


def split_init_addr(init_addr: str) -> tuple[str, int]:
    """(host, port) of `host:port` (`[v6]:port` too); ValueError naming --dist-init-addr
    otherwise, or for a wildcard host (rank 0 would listen on every interface)."""
    host, _, port = init_addr.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--dist-init-addr must be host:port; got {init_addr!r}")
    if host == "*" or _is_unspecified(host):
        raise ValueError(
            f"--dist-init-addr {init_addr!r} is a wildcard: name the one address the ranks "
            f"meet at (default {DEFAULT_INIT_ADDR}); rank 0 listens there only"
        )
    return host, int(port)


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        return False
