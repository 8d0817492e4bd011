"""torch.compile of CPU decode steps (--enable-torch-compile): fewer, fused ops per layer.

On CPU a decode step pays ~10 ms of Python across the layers and ~9 ms of small ops (norms,
RoPE, the K/V write) around the matmuls (docs/performance.md). Inductor traces the model to
its final norm once per padded batch size and fuses the small ops into generated C++. As with
CUDA graphs (model/cuda_graph.py, whose buffers and batch sizes this reuses), a decode step of
n requests runs the compiled step of the smallest size >= n, padding rows writing into the
scratch slot; the LM head runs eagerly on the real rows.

What the trace holds:
- attention: cpu_fused's C++ `paged_decode`, an opaque op with a fake (shape-only) impl
  registered here; its metadata is built eagerly before the call, from host lengths;
- the K/V write: `KVPool.write` turns into an in-place custom op while traced;
- quantized linears: torch's int8 / int4 packed-weight kernels are aten ops and trace as is.
Each size compiles on its first use (seconds to a minute) and inductor caches the generated
code on disk (its own cache dir), so a restart compiles faster. Where compiling fails, one
log line, and every later step runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
import shutil
import time
from collections.abc import Callable, Sequence

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.cpu_fused import CpuFusedBackend
from radixserve.forward_batch import ForwardBatch
from radixserve.model.cuda_graph import DecodeGraphBuffers, fits_decode_graphs
from radixserve.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DecodeStep = Callable[[ForwardBatch], torch.Tensor]
Compiler = Callable[[DecodeStep], DecodeStep]

_fake_registered = False


def inductor_compile(fn: DecodeStep) -> DecodeStep:
    """torch.compile with static shapes: one specialized step per padded batch size."""
    return torch.compile(fn, dynamic=False)


def compile_unavailable_reason(model: LlamaForCausalLM, attn: AttentionBackend) -> str | None:
    """Why decode steps cannot be compiled here, or None when they can."""
    if attn.pool.device.type != "cpu":
        return "it compiles CPU decode steps; on CUDA decode steps replay CUDA graphs"
    if not isinstance(attn, CpuFusedBackend):
        return f"it needs the cpu_fused attention backend, not {type(attn).__name__}"
    if model.tp.size > 1:
        return "tensor parallelism (collectives) is not traced"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "inductor needs a C++ compiler and none is on PATH"
    return None


def register_fake_attention() -> None:
    """Tells the tracer what `paged_decode` returns (q's shape and dtype) without running it."""
    global _fake_registered
    if _fake_registered:
        return

    @torch.library.register_fake("radixserve_cpu::paged_decode")
    def _paged_decode_fake(q, k_pool, v_pool, page_table, seq_lens, *args, **kwargs):
        return torch.empty_like(q)

    _fake_registered = True


class CompiledDecodeRunner:
    """Runs pure-decode batches through a step compiled per padded batch size."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        batch_sizes: Sequence[int],
        max_pages: int,
        page_size: int,
        compiler: Compiler = inductor_compile,
    ):
        self.model, self.attn, self.page_size = model, attn, page_size
        self.batch_sizes, self.max_pages = sorted(batch_sizes), max_pages
        self.buffers = DecodeGraphBuffers(self.batch_sizes[-1], max_pages, attn.pool.device)
        model.rotary.reserve(max_pages * page_size, attn.pool.device)  # no growth in a trace
        self.static_batches = {bs: self.buffers.batch(bs, page_size) for bs in self.batch_sizes}
        register_fake_attention()
        self.step = compiler(self._forward)
        self.compiled: set[int] = set()  # sizes whose first (compiling) run succeeded
        self.failure: str | None = None
        self.compile_seconds: dict[int, float] = {}
        # Each size is one more compiled entry of `_forward`: keep dynamo from giving up on
        # the later ones (default limit 8 entries per function, shared by all runners).
        torch._dynamo.config.recompile_limit += len(self.batch_sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.failure is None and fits_decode_graphs(
            batch, self.batch_sizes[-1], self.max_pages
        )

    def padded_size(self, num_reqs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_reqs)]

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Final hidden states [num_reqs, hidden] of a batch that `can_run`; None when its
        size failed to compile (logged once; the caller then runs the step eagerly)."""
        n, padded = batch.num_reqs, self.padded_size(batch.num_reqs)
        self.buffers.load(batch, padded)
        static = self.static_batches[padded]
        static.prefix_lens = batch.prefix_lens + [0] * (padded - n)  # padding: seq_len 1
        self.attn.init_forward(static)
        if padded in self.compiled:
            return self.step(static)[:n]
        return self._first_run(static, padded, n)

    def _first_run(self, static: ForwardBatch, padded: int, n: int) -> torch.Tensor | None:
        start = time.perf_counter()
        try:
            hidden = self.step(static)
        except Exception as exc:  # any compile failure: run eagerly from now on
            self.failure = _first_line(exc)
            logger.warning(
                "torch.compile of decode steps failed, running eagerly: %s", self.failure
            )
            return None
        self.compile_seconds[padded] = time.perf_counter() - start
        self.compiled.add(padded)
        logger.info(
            "compiled the decode step for batch %d in %.1fs", padded, self.compile_seconds[padded]
        )
        return hidden[:n]

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """What is compiled: the model to its final norm, over a padded static batch."""
        return self.model(batch, self.attn)


def _first_line(exc: Exception) -> str:
    """The exception's type and first message line (inductor's errors run to pages)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
