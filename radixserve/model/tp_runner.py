"""TPModelRunner: the model runner of a tensor-parallel engine, on rank 0.

It looks like a ModelRunner to the scheduler (pool, config, device, forward) and owns the
worker processes of ranks 1..tp-1. Rank 0's own shard is an ordinary ModelRunner; each
forward first sends the batch to the other ranks (tp_batch.py), then runs it, the collectives
inside the model keeping the ranks in step; the gathered logits land on every rank and rank 0
samples from them. The allocator lives on rank 0 only, so pages it hands out for the first
time travel with the next batch to be zeroed everywhere.

Any failure inside a forward (a rank that died, a collective that timed out, a bug on one
rank) leaves the ranks out of step: it raises RankFailedError, which stops the engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.config import CacheConfig, LoadConfig, ModelConfig, ParallelConfig
from radixserve.distributed.group import RankFailedError
from radixserve.distributed.rendezvous import listen_for_ranks
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import LoadedModel, peek_model_config, refuse_sharded_quantization
from radixserve.model.runner import LogitsOutput, ModelRunner
from radixserve.model.tp_batch import pack_batch
from radixserve.model.tp_process import RankProcess
from radixserve.model.tp_shard import check_tp_size
from radixserve.model.tp_worker import RankSpec, build_rank

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # a worker told to stop that has not exited by then is terminated
FAILED_START_JOIN_S = 2.0  # the same after a failed start (a silent rank reads nothing)


@dataclass
class _Worker:
    rank: int
    process: RankProcess
    conn: Connection
    error: str | None = None  # what it reported before it died, if anything

    def poll_error(self) -> str | None:
        try:
            while self.conn.poll(0):
                kind, message = self.conn.recv()
                if kind == "error":
                    self.error = message
        except (EOFError, OSError):
            pass
        return self.error

    def describe_exit(self) -> str:
        """`rank r exited (code c): <its error>`, then its last output, if any."""
        text = f"rank {self.rank} exited (code {self.process.exitcode})"
        if self.poll_error():
            text += f": {self.error}"
        output = self.process.last_output()
        return text + (f"; its last output:\n{output}" if output else "")


@dataclass
class TPModelRunner:
    loaded: LoadedModel  # rank 0's shard, with the full model's config and tokenizer
    local: ModelRunner  # rank 0's shard
    workers: list[_Worker]
    _new_pages: list[torch.Tensor] = field(default_factory=list)
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
    ) -> TPModelRunner:
        """Spawns ranks 1..tp-1, builds rank 0 here, returns once every rank is ready."""
        parallel_config.verify()
        # refused before any process starts; `auto` resolving to a packed method is refused
        # by every rank's loader
        refuse_sharded_quantization(load_config.quantization, parallel_config.tp_size)
        parallel_config.torch_backend(load_config.torch_device())  # nccl off CUDA: refused
        check_tp_size(peek_model_config(load_config), parallel_config.tp_size)
        # rank 0 listens before any rank starts: the others get the port it got
        listen_socket, init_addr = listen_for_ranks(parallel_config.dist_init_addr)
        spec = RankSpec(
            load_config=load_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            init_addr=init_addr,
            context_length=context_length,
            num_threads=torch.get_num_threads(),
            log_level=logging.getLogger().level,
        )
        deadline = time.monotonic() + parallel_config.dist_timeout
        workers: list[_Worker] = []
        try:
            for rank in range(1, parallel_config.tp_size):
                workers.append(_spawn(rank, spec))
            _wait_for(workers, "hello", deadline)  # alive, imported, device set
            loaded, local = build_rank(0, spec, listen_socket)
            _wait_for(workers, "ready", deadline)
        except BaseException as exc:
            listen_socket.close()  # a no-op once the store took it
            failed = [w for w in workers if w.poll_error() or not w.process.is_alive()]
            _stop(workers, FAILED_START_JOIN_S)
            if isinstance(exc, RankFailedError):
                raise
            reasons = [w.describe_exit() for w in failed]
            if reasons:
                message = "tensor-parallel start failed: " + "; ".join(reasons)
                raise RankFailedError(message) from exc
            raise
        runner = cls(loaded=loaded, local=local, workers=workers)
        local.pool.allocator.on_first_use = runner._on_first_use
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
        return len(self.workers) + 1

    # ---- forward and lifecycle -----------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Sends the batch to every rank, runs rank 0's shard; raises RankFailedError when a
        rank is gone or any part of the step fails."""
        self._check_workers()
        try:
            new_pages = torch.cat(self._new_pages) if self._new_pages else _NO_PAGES
            self._new_pages.clear()
            header, payload = pack_batch(batch, new_pages)
            for worker in self.workers:
                worker.conn.send(tuple(header))
            self.model.tp.broadcast(payload)
            return self.local.forward(batch)
        except Exception as exc:
            raise RankFailedError(self._failure(exc)) from exc

    def close(self) -> None:
        """Tells every worker to stop and joins it (terminating one that hangs)."""
        if self._closed:
            return
        self._closed = True
        _stop(self.workers)
        self.model.tp.close()

    def _on_first_use(self, pages: torch.Tensor) -> None:
        self.local.pool.zero_pages(pages)
        self._new_pages.append(pages.clone())

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
        return "tensor-parallel step failed; " + "; ".join(parts)


_NO_PAGES = torch.empty(0, dtype=torch.int64)


def _spawn(rank: int, spec: RankSpec) -> _Worker:
    process = RankProcess(rank)
    process.conn.send(spec)
    return _Worker(rank=rank, process=process, conn=process.conn)


def _wait_for(workers: list[_Worker], kind: str, deadline: float) -> None:
    """Waits until every rank has sent `kind` ("hello", "ready"); RankFailedError naming the
    first rank that reports an error, exits or is still silent at `deadline`."""
    for w in workers:
        while not w.conn.poll(0.1):
            if not w.process.is_alive():
                w.process.join(1.0)
                raise RankFailedError(f"tensor-parallel start failed: {w.describe_exit()}")
            if time.monotonic() > deadline:
                output = w.process.last_output() or "(none)"
                raise RankFailedError(
                    f"tensor-parallel start failed: rank {w.rank} did not report {kind} within "
                    f"--dist-timeout; its last output:\n{output}"
                )
        try:
            got, message = w.conn.recv()
        except (EOFError, OSError):
            got, message = "error", "its channel closed"
        if got != kind:
            w.error = message
            w.process.join(JOIN_TIMEOUT_S)
            raise RankFailedError(f"tensor-parallel start failed: {w.describe_exit()}")


def _stop(workers: list[_Worker], join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except OSError:
            pass
    for w in workers:
        w.process.join(join_timeout_s)
        if w.process.is_alive():
            logger.warning("tensor-parallel rank %d did not stop; terminating it", w.rank)
            w.process.terminate()
            w.process.join()
