"""A node > 0 of a multi-node tensor-parallel group: `radixserve serve --node-rank R`.

    node 0 (`serve`, HTTP)                      node R (this process, no HTTP)
      rank 0: TCPStore at --dist-init-addr <---   ranks R*k .. R*k+k-1 join it (k: ranks per
                                                  node); this process is rank R*k, its leader,
                                                  the others its RankProcesses (tp_local.py)
      headers group: BatchHeader  ---------->     leader: relays it down its ranks' pipes
      broadcast(payload), all-reduces <=====>     every rank: receive_batch, forward
      headers group: stop  ----------------->     leader: stops its ranks, exits 0

The header crosses machines as an int64 tensor over torch.distributed (gloo), never pickled:
pipes carry headers only between the processes of one machine. A leader that loses rank 0
(its connection closes, or a collective times out) stops its ranks and exits non-zero; rank 0
sees this node's ranks gone at its next step and stops the engine (RankFailedError).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from radixserve.config import CacheConfig, LoadConfig, ParallelConfig, split_engine_kwargs
from radixserve.distributed.group import RankFailedError, TPGroup
from radixserve.model.loader import peek_model_config
from radixserve.model.tp_batch import HEADER_LEN, BatchHeader, header_from_tensor
from radixserve.model.tp_local import (
    LocalRank,
    failed_start,
    send_header,
    spawn_rank,
    stop_ranks,
    wait_for,
)
from radixserve.model.tp_shard import check_tp_size
from radixserve.model.tp_worker import RankSpec, build_rank, serve_forwards

logger = logging.getLogger(__name__)


def serve_node(engine_args: dict[str, Any], log_level: str = "info") -> int:
    """Runs this node's ranks until node 0 stops them (0) or the group fails (1)."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    load, cache, scheduler, parallel, *_ = split_engine_kwargs(None, engine_args)
    spec = node_spec(load, cache, parallel, scheduler.context_length)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    leader = parallel.node_ranks()[0]
    workers = start_node(spec)
    try:
        return _serve(leader, spec, workers)
    finally:
        stop_ranks(workers)


def node_spec(
    load: LoadConfig, cache: CacheConfig, parallel: ParallelConfig, context_length: int | None
) -> RankSpec:
    """The RankSpec of this node's ranks; ValueError naming the flag for a bad combination."""
    parallel.verify()
    if parallel.nnodes == 1 or parallel.node_rank == 0:
        raise ValueError("--node-rank R > 0 with --nnodes > 1 runs a node's ranks alone")
    parallel.torch_backend(load.torch_device())
    check_tp_size(peek_model_config(load), parallel.tp_size)
    return RankSpec(
        load_config=load,
        cache_config=cache,
        parallel_config=parallel,
        init_addr=parallel.dist_init_addr,
        context_length=context_length,
        num_threads=torch.get_num_threads(),
        log_level=logging.getLogger().level,
    )


def start_node(spec: RankSpec) -> list[LocalRank]:
    """Starts this node's ranks but its first; returns once each said hello."""
    deadline = time.monotonic() + spec.parallel_config.dist_timeout
    workers: list[LocalRank] = []
    try:
        for rank in spec.parallel_config.node_ranks()[1:]:
            workers.append(spawn_rank(rank, spec))
        wait_for(workers, "hello", deadline)
    except BaseException as exc:
        error = failed_start(workers, exc)
        if error is exc:
            raise
        raise error from exc
    return workers


def _serve(leader: int, spec: RankSpec, workers: list[LocalRank]) -> int:
    parallel = spec.parallel_config
    deadline = time.monotonic() + parallel.dist_timeout
    try:
        _, runner = build_rank(leader, spec)
    except ValueError:  # the ranks disagree on a flag: the message names it
        raise
    except Exception as exc:
        raise RankFailedError(
            f"could not join the group at --dist-init-addr {parallel.dist_init_addr} "
            f"within --dist-timeout {parallel.dist_timeout:g} s: {type(exc).__name__}: {exc}"
        ) from exc
    tp = runner.model.tp
    try:
        wait_for(workers, "ready", deadline)
        logger.info(
            "node %d: ranks %s joined the group at %s",
            parallel.node_rank,
            list(parallel.node_ranks()),
            parallel.dist_init_addr,
        )
        serve_forwards(runner, lambda: relay_header(tp, workers))
    except Exception as exc:
        logger.error(
            "node %d: the tensor-parallel group failed (node 0 stopped, or a rank of some "
            "node died): %s",
            parallel.node_rank,
            exc,
        )
        return 1
    finally:
        tp.close()
    logger.info("node %d: node 0 stopped the group", parallel.node_rank)
    return 0


def relay_header(tp: TPGroup, workers: list[LocalRank]) -> BatchHeader | None:
    """Waits for rank 0's next header and hands it to this node's other ranks."""
    header = header_from_tensor(tp.broadcast_header(torch.empty(HEADER_LEN, dtype=torch.int64)))
    send_header(workers, None if header is None else tuple(header))
    return header
