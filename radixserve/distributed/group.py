"""TPGroup: this rank's place in the tensor-parallel group and the collectives the model needs.

A group of one (`TPGroup.single()`) is what every single-process engine uses: its collectives
return their input, so the model code reads the same at any tp size. A real group wraps
torch.distributed's default process group (nccl on CUDA, gloo on CPU), created by
`init_tp_group` in every rank's process and destroyed by `close`; where the ranks meet and
which interface they talk on: distributed/rendezvous.py.

Across nodes (--nnodes > 1) rank 0 also needs to wake the ranks of other machines for each
step: the first rank of every node (its leader) joins a second, gloo group, `headers`, over
which rank 0 broadcasts each step's small header (model/tp_batch.py); a leader waits there
while idle (no timeout: rank 0 may stay idle for days; a closed connection ends the wait at
once) and hands the header on to its node's other ranks through their pipes.
"""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from radixserve.distributed.rendezvous import bind_collectives_to, listen_for_ranks, split_init_addr

IDLE_WAIT = timedelta(days=365)
"""How long a node leader waits for rank 0's next step: indefinitely, in effect."""


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the ranks are out of step, so the
    engine cannot go on (the core loop lets this one through instead of aborting a step)."""


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    headers: Any = None  # the node leaders' gloo group (a ProcessGroup), None on one node

    @property
    def leads_a_node(self) -> bool:
        """True on the ranks the `headers` group reaches (rank 0 and each node's first)."""
        return self.headers is not None

    @classmethod
    def single(cls) -> TPGroup:
        return cls(rank=0, size=1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max of `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
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

    def broadcast_header(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's header (a CPU int64 tensor) on every node leader, in place; a leader that
        is not rank 0 blocks here until rank 0 sends one."""
        if self.headers is not None:
            dist.broadcast(x, src=0, group=self.headers)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (the KV pool size all ranks can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def differing(self, values: dict[str, object], device: torch.device) -> list[str]:
        """The names in `values` whose value is not the same on every rank (compared by a
        CRC-32 of each value's repr: ranks on other nodes read their own flags)."""
        if self.size == 1:
            return []
        hashes = [zlib.crc32(repr(v).encode()) for v in values.values()]
        low = torch.tensor(hashes, dtype=torch.int64, device=device)
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        same = (low == high).tolist()
        return [name for name, ok in zip(values, same) if not ok]

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
    leaders: list[int] | None = None,
) -> TPGroup:
    """Joins the group at `init_addr` (host:port): rank 0 serves torch's TCPStore on
    `listen_socket` (from `listen_for_ranks`; opened here when None), the others connect;
    the collectives bind the interface towards that host (distributed/rendezvous.py).
    Blocks until every rank has joined or `timeout_s` passes. `leaders` (the first rank of
    each node, with more than one node): the `headers` group, which every rank creates."""
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
    if not leaders or len(leaders) < 2:
        return TPGroup(rank=rank, size=size)
    # every rank of the default group must take part in creating it, members or not
    headers = dist.new_group(ranks=leaders, timeout=IDLE_WAIT, backend="gloo")
    return TPGroup(rank=rank, size=size, headers=headers if rank in leaders else None)


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
