"""One tensor-parallel rank: join the group, load this rank's shard, run the forwards rank 0
sends. Rank 0 builds its own shard with the same `build_rank`; ranks > 0 run `run_tp_worker`
in their own process, `python -m radixserve.model.tp_worker` (model/tp_process.py).

    rank 0 (scheduler, radix cache)             rank r > 0 (run_tp_worker)
      pipe: RankSpec  ---------------------->     imports done, device checked
      pipe: ("hello", None) <----------------     (rank 0 joins the group after every hello)
      rendezvous, load shards, size the pool together
      pipe: ("ready", None) | ("error", msg) <-
      pipe: BatchHeader  ------------------->     wakes (idle ranks wait here, no timeout;
                                                 on another node its leader relays it:
                                                 model/tp_node.py)
      broadcast(payload) <==================>     receive_batch
      ModelRunner.forward: all-reduces, logits all-gather (collectives time out)
      pipe: None (shutdown)  --------------->     returns; process exits
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.swa_pool import HybridKVPool
from radixserve.config import CacheConfig, LoadConfig, ParallelConfig
from radixserve.distributed.group import TPGroup, init_tp_group
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.runner import ModelRunner
from radixserve.model.tp_batch import BatchHeader, receive_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard (picklable: it crosses the spawn)."""

    load_config: LoadConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    init_addr: str
    context_length: int | None  # the scheduler's; None: the model's max positions
    num_threads: int  # torch threads of each CPU rank
    log_level: int
    tier_ratio: float = 0.0  # an in-memory host tier's share of the default KV memory


def rank_load_config(load_config: LoadConfig, parallel: ParallelConfig, rank: int) -> LoadConfig:
    """On CUDA each rank gets its own device of its node, cuda:<its index there>."""
    if load_config.torch_device().type != "cuda":
        return load_config
    return dataclasses.replace(load_config, device=f"cuda:{parallel.local_index(rank)}")


def build_rank(
    rank: int, spec: RankSpec, listen_socket: socket.socket | None = None
) -> tuple[LoadedModel, ModelRunner]:
    """Joins the group (rank 0 serving the rendezvous on `listen_socket`), loads this rank's
    shard, sizes its KV pool with the others."""
    parallel = spec.parallel_config
    load_config = rank_load_config(spec.load_config, parallel, rank)
    device = load_config.torch_device()
    tp = init_tp_group(
        rank,
        parallel.tp_size,
        parallel.torch_backend(device),
        spec.init_addr,
        parallel.dist_timeout,
        device,
        listen_socket,
        parallel.node_leaders() if parallel.nnodes > 1 else None,
    )
    try:
        loaded = load_model(load_config, tp)
        context_length = spec.context_length or loaded.config.max_position_embeddings
        loaded.model.rotary.reserve(context_length, device)  # before any graph captures it
        runner = ModelRunner.from_loaded(loaded, load_config, spec.cache_config, spec.tier_ratio)
        _check_ranks_agree(tp, loaded, runner, context_length)
        return loaded, runner
    except BaseException:
        tp.close()
        raise


def _check_ranks_agree(
    tp: TPGroup, loaded: LoadedModel, runner: ModelRunner, context_length: int
) -> None:
    """Ranks of other nodes read their own flags: what must be equal everywhere is compared
    once the group stands, a difference refused naming the flags behind it."""
    pool = runner.pool
    values = {
        "the model (--model's config.json)": runner.config,
        "--max-total-tokens / --mem-fraction-static (KV pages)": pool.allocator.num_pages,
        "--swa-full-tokens-ratio (sliding-window pages)": _num_sliding_pages(pool),
        "--page-size": pool.page_size,
        "--dtype / --kv-cache-dtype": (loaded.dtype, pool.dtype),
        "--context-length": context_length,
    }
    differing = tp.differing(values, runner.device)
    if differing:
        raise ValueError(
            "the tensor-parallel ranks disagree on " + ", ".join(differing) + ": give every "
            "node the same flags"
        )


def _num_sliding_pages(pool: KVPool) -> int:
    """Pages of a HybridKVPool's sliding space; 0 for a pool of one space."""
    return pool.sliding.allocator.num_pages if isinstance(pool, HybridKVPool) else 0


def run_tp_worker(rank: int, spec: RankSpec, conn: Connection) -> None:
    """Rank > 0: reports ("hello", None) once its device is set, then ("ready", None) or
    ("error", message), then serves."""
    logging.basicConfig(level=spec.log_level, format=f"%(levelname)s tp{rank}: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(spec.num_threads)
    try:
        device = rank_load_config(spec.load_config, spec.parallel_config, rank).torch_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # a missing device fails here, before the group
        conn.send(("hello", None))
        _, runner = build_rank(rank, spec)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    conn.send(("ready", None))
    try:
        serve_forwards(runner, lambda: _header_from(conn))
    except BaseException as exc:
        logger.exception("tensor-parallel rank %d failed", rank)
        _send_quietly(conn, ("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    finally:
        runner.model.tp.close()


@torch.inference_mode()
def serve_forwards(runner: ModelRunner, next_header: Callable[[], BatchHeader | None]) -> None:
    """Runs each forward `next_header` announces, until it returns None (stop)."""
    tp = runner.model.tp
    while (header := next_header()) is not None:
        batch, updates = receive_batch(header, tp, runner.device)
        updates.apply_to(runner.pool)
        runner.forward(batch)


def _header_from(conn: Connection) -> BatchHeader | None:
    """The next header on this rank's pipe; None for stop or once its node's leader is gone."""
    try:
        header = conn.recv()
    except EOFError:
        return None
    return None if header is None else BatchHeader(*header)


def _send_quietly(conn: Connection, message) -> None:
    try:
        conn.send(message)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    """`python -m radixserve.model.tp_worker --rank R --fd FD`: FD is this rank's end of the
    socket pair rank 0 made (model/tp_process.py); the RankSpec arrives on it first."""
    parser = argparse.ArgumentParser(prog="python -m radixserve.model.tp_worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    conn = Connection(args.fd)
    try:
        spec = conn.recv()
    except (EOFError, OSError):  # rank 0 went away before it sent anything
        sys.exit(1)
    run_tp_worker(args.rank, spec, conn)


if __name__ == "__main__":
    main()
