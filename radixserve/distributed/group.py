"""TPGroup: this rank's place in the tensor-parallel group and the collectives the model needs.

A group of one (`TPGroup.single()`) is what every single-process engine uses: its collectives
return their input, so the model code reads the same at any tp size. A real group wraps
torch.distributed's default process group (nccl on CUDA, gloo on CPU), created by
`init_tp_group` in every rank's process and destroyed by `close`; where the ranks meet and
which interface they talk on: distributed/rendezvous.py.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from radixserve.distributed.rendezvous import bind_collectives_to, listen_for_ranks, split_init_addr


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the ranks are out of step, so the
    engine cannot go on (the core loop lets this one through instead of aborting a step)."""


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int

    @classmethod
    def single(cls) -> TPGroup:
        return cls(rank=0, size=1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (the KV pool size all ranks can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(
    rank: int,
    size: int,
    backend: str,
    init_addr: str,
    timeout_s: float,
    device: torch.device,
    listen_socket: socket.socket | None = None,
) -> TPGroup:
    """Joins the group at `init_addr` (host:port): rank 0 serves torch's TCPStore on
    `listen_socket` (from `listen_for_ranks`; opened here when None), the others connect;
    the collectives bind the interface towards that host (distributed/rendezvous.py).
    Blocks until every rank has joined or `timeout_s` passes."""
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed group already exists in this process: one tensor-parallel "
            "engine per process (shut the other down first)"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, port = split_init_addr(init_addr)
    bind_collectives_to(host, port, backend)
    timeout = timedelta(seconds=timeout_s)
    store = _store(rank, size, host, port, timeout, listen_socket)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=size, timeout=timeout
    )
    return TPGroup(rank=rank, size=size)


def _store(
    rank: int,
    size: int,
    host: str,
    port: int,
    timeout: timedelta,
    listen_socket: socket.socket | None,
) -> dist.TCPStore:
    """Rank 0: the store's server on a socket bound to `host` only; others: its clients."""
    if rank != 0:
        return dist.TCPStore(host, port, size, False, timeout)
    if listen_socket is None:
        listen_socket, _ = listen_for_ranks(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    port = listen_socket.getsockname()[1]
    fd = listen_socket.detach()  # the store owns it from here
    try:
        return dist.TCPStore(
            host, port, size, True, timeout, wait_for_workers=False, master_listen_fd=fd
        )
    except BaseException:
        os.close(fd)
        raise
