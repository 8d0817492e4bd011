"""ParallelConfig: tensor parallelism's rank count and torch.distributed setup."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DIST_BACKENDS = ("auto", "nccl", "gloo")
DEFAULT_INIT_ADDR = "127.0.0.1:0"  # loopback, a port the kernel picks
MAX_TIMEDELTA_S = timedelta.max.total_seconds()  # --dist-timeout becomes a timedelta


@dataclass
class ParallelConfig:
    """Tensor parallelism: how many ranks share the model, and how they talk."""

    tp_size: int = 1
    """Tensor-parallel ranks (processes, one device each); rank 0 runs the scheduler and the
    radix cache, every rank holds 1/tp of the attention heads, MLP and vocabulary."""
    ep_size: int = 1
    """Expert-parallel ranks of a mixture-of-experts model (SGLang's name): its experts split
    evenly over the tensor-parallel ranks, each rank running its own on every token, one
    all-reduce summing them. 1 or --tp-size; a MoE model under --tp-size N > 1 needs
    --ep-size N (experts are not split by column), and N must divide its experts."""
    dist_backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU) | nccl | gloo: the torch.distributed backend of
    --tp-size > 1."""
    dist_init_addr: str | None = None
    """host:port where the ranks rendezvous: rank 0 listens on that address only (torch's
    TCPStore, no authentication), and gloo / nccl use the interface towards it
    (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unless set); port 0: any free one. Default:
    127.0.0.1:0 (loopback). A wildcard host is refused. With --nnodes > 1: node 0's address
    and a fixed port, which every node reaches, on a network only the ranks share."""
    dist_timeout: float = 300.0
    """Seconds a collective (or the rendezvous) may wait for the other ranks before the engine
    stops with an error, and the start-up bound: a rank not ready by then fails the start,
    named with its last output; a rank that exits is noticed sooner."""

    nnodes: int = 1
    """Machines the tensor-parallel ranks span (SGLang's flag): each runs --tp-size / nnodes
    ranks; node 0 (rank 0) serves HTTP, the others only run their ranks."""
    node_rank: int = 0
    """This machine's index among --nnodes: 0 serves HTTP; R > 0 runs ranks
    R * (tp / nnodes) .., joining node 0 at --dist-init-addr, and exits when it stops."""

    def verify(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1; got {self.tp_size}")
        self._verify_nodes()
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"--ep-size must be 1 or --tp-size ({self.tp_size}); got {self.ep_size}"
            )
        if self.dist_backend not in DIST_BACKENDS:
            allowed = ", ".join(DIST_BACKENDS)
            raise ValueError(f"--dist-backend must be one of {allowed}; got {self.dist_backend!r}")
        if not 0 < self.dist_timeout <= MAX_TIMEDELTA_S:  # torch.distributed takes a timedelta
            raise ValueError(
                f"--dist-timeout must be seconds in (0, {MAX_TIMEDELTA_S:.0f}]; "
                f"got {self.dist_timeout}"
            )
        if self.dist_init_addr is not None:
            split_init_addr(self.dist_init_addr)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def node_ranks(self, node: int | None = None) -> range:
        """The ranks node `node` (default: this one) runs, its first one leading it."""
        node = self.node_rank if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def node_leaders(self) -> list[int]:
        """The first rank of every node: rank 0 sends them each step's header."""
        return [node * self.ranks_per_node for node in range(self.nnodes)]

    def local_index(self, rank: int) -> int:
        """`rank`'s place on its own node (its CUDA device there)."""
        return rank % self.ranks_per_node

    def _verify_nodes(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1; got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be in [0, --nnodes {self.nnodes}); got {self.node_rank}"
            )
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"--nnodes {self.nnodes} must divide --tp-size {self.tp_size} (ranks per node)"
            )
        if self.nnodes == 1:
            return
        if self.dist_init_addr is None or split_init_addr(self.dist_init_addr)[1] == 0:
            raise ValueError(
                f"--nnodes {self.nnodes} needs --dist-init-addr host:port with a fixed port "
                f"on node 0, the same on every node; got {self.dist_init_addr!r}"
            )

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
