"""TPModelRunner: the model runner of a tensor-parallel engine, on rank 0.

It looks like a ModelRunner to the scheduler (pool, config, device, forward) and owns the
worker processes of ranks 1..tp-1. Rank 0's own shard is an ordinary ModelRunner; each
forward first sends the batch to the other ranks (tp_batch.py), then runs it, the collectives
inside the model keeping the ranks in step; the gathered logits land on every rank and rank 0
samples from them. The allocator lives on rank 0 only, so pages it hands out for the first
time travel with the next batch to be zeroed everywhere, and with a sliding-window model's
two page spaces (cache/swa_pool.py) so do the sliding-page table entries it rewrote: every
rank holds its shard of the heads in the same pages.

Any failure inside a forward (a rank that died, a collective that timed out, a bug on one
rank) leaves the ranks out of step: it raises RankFailedError, which stops the engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.swa_pool import HybridKVPool
from radixserve.config import CacheConfig, LoadConfig, ModelConfig, ParallelConfig
from radixserve.distributed.group import RankFailedError
from radixserve.distributed.rendezvous import listen_for_ranks
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import LoadedModel, check_rank_quantization, peek_model_config
from radixserve.model.moe import check_ep_size
from radixserve.model.runner import LogitsOutput, ModelRunner
from radixserve.model.tp_batch import PageUpdates, header_tensor, pack_batch
from radixserve.model.tp_local import (
    LocalRank,
    failed_start,
    send_header,
    spawn_rank,
    stop_ranks,
    wait_for,
)
from radixserve.model.tp_shard import ShardLayout, check_tp_size
from radixserve.model.tp_worker import RankSpec, build_rank

logger = logging.getLogger(__name__)


@dataclass
class TPModelRunner:
    loaded: LoadedModel  # rank 0's shard, with the full model's config and tokenizer
    local: ModelRunner  # rank 0's shard
    workers: list[LocalRank]  # the other ranks of node 0
    parallel: ParallelConfig
    _new_pages: list[torch.Tensor] = field(default_factory=list)
    _new_sliding_pages: list[torch.Tensor] = field(default_factory=list)
    _closed: bool = False

    @property
    def lora(self) -> None:
        """No LoRA weights: EngineCore refuses --enable-lora with --tp-size > 1."""
        return None

    @classmethod
    def create(
        cls,
        load_config: LoadConfig,
        cache_config: CacheConfig,
        parallel_config: ParallelConfig,
        context_length: int | None = None,
        tier_ratio: float = 0.0,
    ) -> TPModelRunner:
        """Spawns node 0's other ranks, builds rank 0 here, returns once every rank (those of
        other nodes too) has joined and is ready."""
        parallel_config.verify()
        if parallel_config.node_rank != 0:
            raise ValueError(
                f"--node-rank {parallel_config.node_rank}: only node 0 runs the engine; "
                "the others run their ranks alone (`radixserve serve --node-rank R`)"
            )
        parallel_config.torch_backend(load_config.torch_device())  # nccl off CUDA: refused
        model_config = peek_model_config(load_config)
        check_tp_size(model_config, parallel_config.tp_size)
        if load_config.quantization != "auto":  # `auto` resolves in each rank's loader
            layout = ShardLayout(model_config, 0, parallel_config.tp_size)
            check_rank_quantization(load_config, layout)  # before any rank starts
        check_ep_size(model_config, parallel_config.tp_size, parallel_config.ep_size)
        # rank 0 listens before any rank starts: the others get the port it got
        listen_socket, init_addr = listen_for_ranks(parallel_config.dist_init_addr)
        spec = RankSpec(
            load_config=load_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            init_addr=init_addr,
            context_length=context_length,
            tier_ratio=tier_ratio,
            num_threads=torch.get_num_threads(),
            log_level=logging.getLogger().level,
        )
        deadline = time.monotonic() + parallel_config.dist_timeout
        workers: list[LocalRank] = []
        try:
            for rank in parallel_config.node_ranks(0)[1:]:
                workers.append(spawn_rank(rank, spec))
            wait_for(workers, "hello", deadline)  # alive, imported, device set
            loaded, local = build_rank(0, spec, listen_socket)
            wait_for(workers, "ready", deadline)
        except BaseException as exc:
            listen_socket.close()  # a no-op once the store took it
            error = failed_start(workers, exc)
            if error is exc:
                raise
            raise error from exc
        runner = cls(loaded=loaded, local=local, workers=workers, parallel=parallel_config)
        runner._track_pages(local.pool)
        logger.info("tensor parallel: %d ranks ready", parallel_config.tp_size)
        return runner

    # ---- what the scheduler and the engine read ------------------------------------------

    @property
    def pool(self) -> KVPool:
        return self.local.pool

    @property
    def config(self) -> ModelConfig:
        return self.local.config

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def model(self) -> LlamaForCausalLM:
        return self.local.model

    @property
    def tp_size(self) -> int:
        return self.parallel.tp_size

    # ---- forward and lifecycle -----------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Sends the batch to every rank, runs rank 0's shard; raises RankFailedError when a
        rank is gone or any part of the step fails."""
        self._check_workers()
        try:
            header, payload = pack_batch(batch, self._take_page_updates())
            send_header(self.workers, tuple(header))
            self.model.tp.broadcast_header(header_tensor(header))  # other nodes' leaders
            self.model.tp.broadcast(payload)
            return self.local.forward(batch)
        except Exception as exc:
            raise RankFailedError(self._failure(exc)) from exc

    def close(self) -> None:
        """Tells every worker to stop and joins it (terminating one that hangs)."""
        if self._closed:
            return
        self._closed = True
        stop_ranks(self.workers)
        try:
            self.model.tp.broadcast_header(header_tensor(None))  # other nodes: stop
        except Exception:  # a node already gone: nothing to tell it
            logger.warning("tensor parallel: could not tell the other nodes to stop")
        self.model.tp.close()

    def _track_pages(self, pool: KVPool) -> None:
        """Records what the other ranks' pools must repeat (PageUpdates)."""
        pool.allocator.on_first_use = self._on_first_use
        if isinstance(pool, HybridKVPool):
            pool.allocator.track_changes()
            pool.allocator.sliding.on_first_use = self._on_first_sliding_use

    def _on_first_use(self, pages: torch.Tensor) -> None:
        self.local.pool.zero_pages(pages)
        self._new_pages.append(pages.clone())

    def _on_first_sliding_use(self, pages: torch.Tensor) -> None:
        self.local.pool.sliding.zero_pages(pages)
        self._new_sliding_pages.append(pages.clone())

    def _take_page_updates(self) -> PageUpdates:
        updates = PageUpdates(new_pages=_take(self._new_pages))
        pool = self.local.pool
        if isinstance(pool, HybridKVPool):
            remapped, sliding = pool.allocator.take_changes()
            new_sliding = _take(self._new_sliding_pages)
            updates = updates._replace(
                remapped=remapped, sliding=sliding, new_sliding_pages=new_sliding
            )
        return updates

    def _check_workers(self) -> None:
        dead = [w for w in self.workers if not w.process.is_alive()]
        if dead:
            raise RankFailedError(self._failure(None))

    def _failure(self, exc: Exception | None) -> str:
        time.sleep(0.1)  # a rank that crashed has a moment to exit and report why
        parts = []
        for w in self.workers:
            if not w.process.is_alive():
                parts.append(w.describe_exit())
        if exc is not None:
            parts.append(f"rank 0: {type(exc).__name__}: {exc}")
        if self.parallel.nnodes > 1:
            parts.append(
                f"the ranks span --nnodes {self.parallel.nnodes}: a node that stopped is "
                "named in its own log"
            )
        return "tensor-parallel step failed; " + "; ".join(parts)


def _take(parts: list[torch.Tensor]) -> torch.Tensor:
    """The pages in `parts`, as one tensor; empties the list."""
    pages = torch.cat(parts) if parts else _NO_PAGES
    parts.clear()
    return pages


_NO_PAGES = torch.empty(0, dtype=torch.int64)
