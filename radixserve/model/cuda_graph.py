"""CUDA graphs for decode steps: captured once per batch size, replayed with the batch copied in.

A decode step of n requests (one new token each) replays the graph of the smallest captured
size >= n. The graphs read static buffers, allocated once for the largest size:

    row:           0 .. n-1 (the batch)      n .. padded-1 (padding)     padded .. max_bs-1
    input_ids      the batch's               0                           unused
    positions      the batch's               0
    out_slots      the batch's               0 (slot 0: scratch page 0)
    seq_lens       positions + 1             1
    page_table     the batch's pages         page 0 in column 0

Padding rows write their K/V into the scratch slot and attend to it alone, so every kernel
stays in bounds and no real page is touched; their outputs are dropped. A graph ends at the
final norm: the LM head runs eagerly on the real rows (one matmul), so logits are exactly the
eager path's, no [bs, vocab] fp32 output is kept per graph, and no replay overwrites logits a
caller still holds. The graph object is injectable (`GraphFactory`): on CPU the tests pass a
stand-in that reruns the captured callable, which is what a replay of its kernels does.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.triton_backend import MAX_GRAPH_SPLITS
from radixserve.config import ModelConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaForCausalLM

WARMUP_RUNS = 2  # eager runs before a capture: Triton compiles, cuBLAS picks its kernels
GRAPH_SLACK_BYTES = 256 << 20  # cuBLAS workspaces, allocator rounding


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        """Records `fn` (which reads and writes only static buffers)."""

    def replay(self) -> torch.Tensor:
        """Reruns what was recorded; returns `fn`'s output (static memory on CUDA)."""


GraphFactory = Callable[[], Graph]


class CudaGraph:
    """torch.cuda.CUDAGraph over a callable, on a memory pool shared by all sizes."""

    def __init__(self, pool: object, stream: torch.cuda.Stream):
        self.pool, self.stream = pool, stream
        self.graph = torch.cuda.CUDAGraph()
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        for _ in range(WARMUP_RUNS):
            fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            self.output = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


def cuda_graph_factory() -> GraphFactory:
    """CudaGraphs sharing one memory pool and one capture stream (as the pool sharing needs)."""
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    return lambda: CudaGraph(pool, stream)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (and max_bs itself)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1; got {max_bs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    return sizes if sizes[-1] == max_bs else [*sizes, max_bs]


class DecodeGraphBuffers:
    """The static inputs of every decode graph, [max_bs] rows (page_table [max_bs, max_pages])."""

    def __init__(self, max_bs: int, max_pages: int, device: torch.device):
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.out_slots = zeros(max_bs), zeros(max_bs), zeros(max_bs)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.page_table = zeros(max_bs, max_pages)

    def load(self, batch: ForwardBatch, padded: int) -> None:
        """Copies a pure-decode batch into rows [0, n) and pads rows [n, padded)."""
        n, width = batch.num_reqs, batch.page_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)
        torch.add(batch.positions, 1, out=self.seq_lens[:n])
        self.page_table[:n, :width].copy_(batch.page_table)
        self.pad(n, padded)

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: token 0 at position 0, K/V in scratch slot 0."""
        for buf in (self.input_ids, self.positions, self.out_slots):
            buf[start:end].zero_()
        self.seq_lens[start:end].fill_(1)
        self.page_table[start:end, :1].zero_()

    def batch(self, n: int, page_size: int) -> ForwardBatch:
        """A ForwardBatch over rows [0, n). Its prefix_lens are placeholders (they change with
        every replay): graph-mode backends read the `seq_lens` tensor instead."""
        return ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            out_slots=self.out_slots[:n],
            page_table=self.page_table[:n],
            extend_lens=[1] * n,
            prefix_lens=[0] * n,
            page_size=page_size,
        )


def fits_decode_graphs(batch: ForwardBatch, max_bs: int, max_pages: int) -> bool:
    """Pure decode, no all-position logits, and within the static buffers' sizes."""
    return (
        batch.num_reqs <= max_bs
        and not batch.return_all_logits
        and batch.verify_indices is None
        and batch.page_table.shape[1] <= max_pages
        and max(batch.extend_lens) == 1
    )


class DecodeGraphRunner:
    """Captures the model's decode step per batch size; replays it for batches that fit."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        batch_sizes: Sequence[int],
        max_pages: int,
        page_size: int,
        new_graph: GraphFactory,
    ):
        self.model, self.attn, self.page_size = model, attn, page_size
        self.batch_sizes = sorted(batch_sizes)
        self.max_pages = max_pages
        device = attn.pool.device
        self.buffers = DecodeGraphBuffers(self.batch_sizes[-1], max_pages, device)
        model.rotary.reserve(max_pages * page_size, device)  # no table growth inside capture
        self.new_graph = new_graph
        self.graphs: dict[int, Graph] = {}
        self.static_batches: dict[int, ForwardBatch] = {}
        self.num_replays = 0

    @property
    def max_bs(self) -> int:
        return self.batch_sizes[-1]

    def capture(self) -> None:
        """Captures every size, largest first, so smaller graphs reuse its pooled memory."""
        for bs in reversed(self.batch_sizes):
            self.buffers.pad(0, bs)
            batch = self.buffers.batch(bs, self.page_size)
            self.attn.plan_graph_decode(batch, [1] * bs)
            graph = self.new_graph()
            graph.capture(lambda batch=batch: self._forward(batch))
            self.graphs[bs], self.static_batches[bs] = graph, batch

    def can_run(self, batch: ForwardBatch) -> bool:
        return fits_decode_graphs(batch, self.max_bs, self.max_pages)

    def padded_size(self, num_reqs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_reqs)]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [num_reqs, hidden] of a batch that `can_run`."""
        n = batch.num_reqs
        padded = self.padded_size(n)
        self.buffers.load(batch, padded)
        seq_lens = batch.seq_lens + [1] * (padded - n)
        self.attn.plan_graph_decode(self.static_batches[padded], seq_lens)
        self.num_replays += 1
        return self.graphs[padded].replay()[:n]

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """What a graph records: graph-safe attention metadata, then the model to its final norm."""
        self.attn.init_graph_decode(batch, self.buffers.seq_lens[: batch.num_reqs])
        return self.model(batch, self.attn)


def estimate_graph_memory(
    config: ModelConfig, batch_sizes: Sequence[int], dtype: torch.dtype
) -> int:
    """Rough upper bound of what captured decode graphs hold: one step's activations at the
    largest size (smaller graphs reuse them through the shared pool), the Triton decode
    kernel's split-K partials, every graph's output, and some slack."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    max_bs = max(batch_sizes)
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_token = itemsize * (4 * config.hidden_size + 2 * (q_size + 2 * kv_size))
    per_token += itemsize * 3 * config.intermediate_size + 4 * 4 * (q_size + kv_size)  # fp32 RoPE
    partials = max_bs * config.num_heads * MAX_GRAPH_SPLITS * (config.head_dim + 1) * 4
    outputs = sum(batch_sizes) * config.hidden_size * itemsize
    return max_bs * per_token + partials + outputs + GRAPH_SLACK_BYTES
