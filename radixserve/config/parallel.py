"""ParallelConfig: tensor parallelism's rank count and torch.distributed setup."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DIST_BACKENDS = ("auto", "nccl", "gloo")


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
    """host:port where the ranks rendezvous (rank 0 listens there); default: a free loopback
    port. For multi-node later: an address every node reaches."""
    dist_timeout: float = 300.0
    """Seconds a collective (or the rendezvous) may wait for the other ranks before the engine
    stops with an error; a rank that exits is noticed sooner."""

    def verify(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1; got {self.tp_size}")
        if self.dist_backend not in DIST_BACKENDS:
            allowed = ", ".join(DIST_BACKENDS)
            raise ValueError(f"--dist-backend must be one of {allowed}; got {self.dist_backend!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout must be > 0; got {self.dist_timeout}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--dist-init-addr must be host:port; got {self.dist_init_addr!r}")

    def torch_backend(self, device: torch.device) -> str:
        """The backend `auto` means on `device`; nccl only on CUDA."""
        if self.dist_backend == "auto":
            return "nccl" if device.type == "cuda" else "gloo"
        if self.dist_backend == "nccl" and device.type != "cuda":
            raise ValueError(f"--dist-backend nccl needs CUDA; the model runs on {device}")
        return self.dist_backend
