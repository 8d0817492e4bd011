"""ModelRunner: owns the model, the KV pool and the attention backend; ForwardBatch -> logits.

On CUDA, pure-decode batches of up to `cuda_graph_max_bs` requests replay captured CUDA graphs
(model/cuda_graph.py); on CPU with `enable_torch_compile`, those of up to `torch_compile_max_bs`
run a step compiled by torch.compile (model/cpu_compile.py); everything else runs eagerly, on
CPU with the layers' small ops fused into C++ ones where they build (model/cpu_layer_ops.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixserve.attention import (
    KV_CASTING_BACKENDS,
    AttentionBackend,
    create_model_attention,
    default_backend,
)
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.swa_pool import create_kv_pool
from radixserve.config import CacheConfig, LoadConfig, ModelConfig
from radixserve.config.cache import CPU_KV_MEMORY_FRACTION
from radixserve.forward_batch import ForwardBatch
from radixserve.model.cpu_compile import CompiledDecodeRunner, compile_unavailable_reason
from radixserve.model.cpu_decode_stack import check_cpu_decode_stack, use_cpu_decode_stack
from radixserve.model.cpu_layer_ops import LAYER_OPS_DTYPES, load_cpu_layer_ops
from radixserve.model.cuda_graph import (
    DecodeGraphRunner,
    GraphFactory,
    capture_batch_sizes,
    cuda_graph_factory,
    estimate_graph_memory,
)
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.lora import LoraWeights
from radixserve.native.machine import GiB, available_memory_bytes

logger = logging.getLogger(__name__)

CPU_KV_FALLBACK_GB = 4.0  # where the available memory cannot be read (not Linux)
CPU_KV_MIN_BYTES = 64 << 20


class LogitsOutput(NamedTuple):
    last: torch.Tensor  # [num_reqs, vocab] fp32: logits at each request's last new token
    all: torch.Tensor | None  # [num_tokens, vocab] fp32 when the batch asked for all positions
    verify: torch.Tensor | None = None  # [num_verify_rows, vocab] fp32 at batch.verify_indices
    aux_hidden: torch.Tensor | None = None  # [num_tokens, k * hidden] when an EAGLE head captures
    hidden: torch.Tensor | None = None  # [num_reqs, hidden] final-normed, with batch.return_hidden


@dataclass
class ModelRunner:
    model: LlamaForCausalLM
    config: ModelConfig
    pool: KVPool
    attn: AttentionBackend
    decode_graphs: DecodeGraphRunner | None = None
    compiled_decode: CompiledDecodeRunner | None = None
    lora: LoraWeights | None = None  # --enable-lora: the adapters' weights (model/lora.py)
    aux_layers: tuple[int, ...] = ()
    """EAGLE heads: layers whose input hidden states every forward returns (eager only);
    llama.FINAL_HIDDEN: the final-normed hidden states (EAGLE-1/2)."""

    @classmethod
    def create(
        cls, load_config: LoadConfig | None = None, cache_config: CacheConfig | None = None
    ) -> ModelRunner:
        """Loads the model, then sizes the KV pool from what memory is left."""
        return cls.from_loaded(load_model(load_config or LoadConfig()), load_config, cache_config)

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        load_config: LoadConfig | None = None,
        cache_config: CacheConfig | None = None,
        tier_ratio: float = 0.0,
    ) -> ModelRunner:
        """Under tensor parallelism every rank calls this at once: the pool and attention
        take the rank's shard of the heads, and all ranks agree on the smallest pool.
        `tier_ratio`: an in-memory host tier's share of the default KV memory (kv_budget_bytes)."""
        load_config = load_config or LoadConfig()
        cache_config = cache_config or CacheConfig()
        check_cpu_decode_stack(load_config.cpu_decode_stack)
        device, dtype = load_config.torch_device(), loaded.dtype
        local = loaded.model.layout.local_config()  # this rank's heads (all, without TP)
        graphs = device.type == "cuda" and not cache_config.disable_cuda_graph
        reserve = 0
        if graphs:
            sizes = capture_batch_sizes(cache_config.cuda_graph_max_bs)
            reserve = estimate_graph_memory(local, sizes, dtype)
        budget = kv_budget_bytes(
            cache_config, device, reserve, num_ranks=loaded.model.tp.size, tier_ratio=tier_ratio
        )
        if budget is not None:
            budget = loaded.model.tp.min_int(budget, device)
        kv_dtype = kv_cache_dtype(cache_config, dtype, device)
        pool = create_kv_pool(local, cache_config, kv_dtype, device, budget_bytes=budget)
        attn = create_model_attention(
            cache_config.attention_backend,
            pool,
            device,
            loaded.config.layer_windows(),
            num_heads=local.num_heads,
            deterministic=load_config.enable_deterministic_inference,
            logit_cap=loaded.config.attn_logit_cap,
        )
        runner = cls(model=loaded.model, config=loaded.config, pool=pool, attn=attn)
        if device.type == "cpu" and {dtype, kv_dtype} <= set(LAYER_OPS_DTYPES):
            loaded.model.use_cpu_layer_ops(load_cpu_layer_ops())
            if not cache_config.enable_torch_compile:
                use_cpu_decode_stack(loaded.model, attn, load_config.cpu_decode_stack)
        if graphs and not attn.supports_cuda_graph:
            logger.info("CUDA graphs off: the %s backend has none", type(attn).__name__)
        elif graphs:
            runner.capture_decode_graphs(cache_config.cuda_graph_max_bs, expected_bytes=reserve)
        if cache_config.enable_torch_compile:
            runner.compile_decode_steps(cache_config.torch_compile_max_bs)
        return runner

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def graph_max_pages(self) -> int:
        """Page-table width of the decode graphs: the longest sequence the model or pool allows."""
        return self.pool.num_pages_for(
            min(self.config.max_position_embeddings, self.pool.capacity_tokens)
        )

    @torch.inference_mode()
    def capture_decode_graphs(
        self, max_bs: int, new_graph: GraphFactory | None = None, expected_bytes: int = 0
    ) -> None:
        """Captures decode steps of up to `max_bs` requests: CUDA graphs, or a stand-in (tests)."""
        graphs = DecodeGraphRunner(
            self.model, self.attn, capture_batch_sizes(max_bs), self.graph_max_pages(),
            self.pool.page_size, new_graph or cuda_graph_factory(),
        )  # fmt: skip
        start, free_before = time.perf_counter(), _free_memory(self.device)
        graphs.capture()
        used = free_before - _free_memory(self.device)
        logger.info(
            "captured %d decode graphs (batch 1..%d, %d pages) in %.1fs, %.2f GiB",
            len(graphs.batch_sizes), max_bs, graphs.max_pages, time.perf_counter() - start,
            used / GiB,
        )  # fmt: skip
        if expected_bytes and used > expected_bytes:
            logger.warning(
                "decode graphs took %.2f GiB, more than the %.2f GiB kept free for them; "
                "lower mem_fraction_static if memory runs short",
                used / GiB, expected_bytes / GiB,
            )  # fmt: skip
        self.decode_graphs = graphs

    def compile_decode_steps(self, max_bs: int) -> None:
        """Sets up decode steps of up to `max_bs` requests to run compiled (each padded size
        compiles on first use); where that cannot work here, says why and stays eager."""
        reason = compile_unavailable_reason(self.model, self.attn)
        if reason is not None:
            logger.warning("--enable-torch-compile ignored: %s", reason)
            return
        self.compiled_decode = CompiledDecodeRunner(
            self.model, self.attn, capture_batch_sizes(max_bs), self.graph_max_pages(),
            self.pool.page_size,
        )  # fmt: skip

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Runs one forward over a mixed extend/decode batch, writing its K/V into the pool."""
        if self.aux_layers:
            return self._forward_capturing(batch)
        captured = batch.lora is None  # LoRA batches run eagerly (no graph holds an adapter)
        if captured and self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            hidden = self.decode_graphs.replay(batch)
            return self._with_hidden(
                LogitsOutput(self.model.compute_logits(hidden), None), hidden, batch
            )
        if captured and self.compiled_decode is not None and self.compiled_decode.can_run(batch):
            hidden = self.compiled_decode.run(batch)
            if hidden is not None:
                out = LogitsOutput(last=self.model.compute_logits(hidden), all=None)
                return self._with_hidden(out, hidden, batch)
        self.attn.init_forward(batch)
        hidden = self.model(batch, self.attn)
        return self._with_hidden(self._logits(hidden, batch), hidden, batch, all_rows=True)

    def _with_hidden(
        self, out: LogitsOutput, hidden: torch.Tensor, batch: ForwardBatch, all_rows: bool = False
    ) -> LogitsOutput:
        """`out` with each request's last final-normed hidden state when the batch asks
        (embedding requests), or a sequence classifier's scores of it; `hidden` holds every
        token's row when `all_rows`, else one row per request (decode graphs)."""
        if not batch.return_hidden:
            return out
        rows = hidden[batch.last_token_indices()] if all_rows else hidden[: batch.num_reqs]
        score = getattr(self.model, "score", None)
        if score is not None:
            rows = score(rows)
        return out._replace(hidden=rows.float())

    def _logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> LogitsOutput:
        """The rows of `hidden` [num_tokens, hidden_size] the batch asks logits of."""
        last_rows = batch.last_token_indices()
        all_logits = self.model.compute_logits(hidden) if batch.return_all_logits else None
        if batch.verify_indices is None:
            return LogitsOutput(last=self.model.compute_logits(hidden[last_rows]), all=all_logits)
        # one LM head call: a verifying request's last row is one of its verify rows
        rows = torch.cat([batch.verify_indices, last_rows]).unique()  # sorted
        logits = self.model.compute_logits(hidden[rows])
        last = logits.index_select(0, torch.searchsorted(rows, last_rows))
        if torch.equal(rows, batch.verify_indices):  # every request verifies: no copy
            return LogitsOutput(last=last, all=all_logits, verify=logits)
        verify = logits.index_select(0, torch.searchsorted(rows, batch.verify_indices))
        return LogitsOutput(last=last, all=all_logits, verify=verify)

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager forward without logits: every token's final (normed) hidden state
        [num_tokens, hidden] and, with `aux_layers` set, their aux hidden states (EAGLE-3
        training reads both; a head's logits over a few thousand ids cost far less than
        the full vocabulary's)."""
        self.attn.init_forward(batch)
        aux: list[torch.Tensor] = []
        model = self.model
        hidden = model.forward_layers(batch, self.attn, model.layers, self.aux_layers, aux)
        return hidden, torch.cat(aux, dim=-1) if aux else None

    def _forward_capturing(self, batch: ForwardBatch) -> LogitsOutput:
        """The eager forward, plus the hidden states of `aux_layers` (EAGLE heads)."""
        self.attn.init_forward(batch)
        aux: list[torch.Tensor] = []
        model = self.model
        hidden = model.forward_layers(batch, self.attn, model.layers, self.aux_layers, aux)
        out = self._with_hidden(self._logits(hidden, batch), hidden, batch, all_rows=True)
        return out._replace(aux_hidden=torch.cat(aux, dim=-1))


def kv_cache_dtype(
    cache_config: CacheConfig, dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The pool's dtype; one other than the model's only where the backend casts on read."""
    kv_dtype = cache_config.kv_torch_dtype(dtype)
    backend = cache_config.attention_backend
    backend = default_backend(device) if backend == "auto" else backend
    if kv_dtype != dtype and backend not in KV_CASTING_BACKENDS:
        raise ValueError(
            f"--kv-cache-dtype {cache_config.kv_cache_dtype} differs from the model's "
            f"{str(dtype).removeprefix('torch.')}, which the {backend} attention backend "
            "cannot read; use --attention-backend torch_native or --kv-cache-dtype auto"
        )
    return kv_dtype


def _free_memory(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def kv_budget_bytes(
    cache_config: CacheConfig,
    device: torch.device,
    reserve_bytes: int = 0,
    num_ranks: int = 1,
    tier_ratio: float = 0.0,
) -> int | None:
    """Memory for the KV pool: on CUDA what mem_fraction_static leaves after the weights and
    `reserve_bytes` (decode graphs); on CPU cpu_kv_cache_gb, else CPU_KV_MEMORY_FRACTION of
    the memory available now (after the weights), split between `num_ranks` TP ranks and
    shared 1 : `tier_ratio` with an in-memory host tier (HiCacheConfig.memory_tier_ratio:
    its pages are host memory too); None when max_total_tokens sizes the pool instead."""
    if cache_config.max_total_tokens is not None:
        return None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cache_config.mem_fraction_static) - used - reserve_bytes
        if budget <= 0:
            raise ValueError(
                f"mem_fraction_static={cache_config.mem_fraction_static} leaves no memory for the "
                f"KV pool ({used / GiB:.1f} GiB of {total / GiB:.1f} GiB already in use, "
                f"{reserve_bytes / GiB:.1f} GiB kept for CUDA graphs)"
            )
        return budget
    if cache_config.cpu_kv_cache_gb is not None:
        return int(cache_config.cpu_kv_cache_gb * GiB)
    available = available_memory_bytes()
    if available is None:
        logger.info("KV pool: %.1f GiB (available memory unknown here)", CPU_KV_FALLBACK_GB)
        return int(CPU_KV_FALLBACK_GB * GiB)
    budget = int(available * CPU_KV_MEMORY_FRACTION / num_ranks / (1 + tier_ratio))
    if budget < CPU_KV_MIN_BYTES:
        raise ValueError(
            f"only {available / GiB:.2f} GiB of memory is available after loading the weights: "
            "too little for a KV pool; give --cpu-kv-cache-gb or --max-total-tokens"
        )
    logger.info(
        "KV pool: %.1f GiB = %.0f%% of the %.1f GiB available%s%s (--cpu-kv-cache-gb or "
        "--max-total-tokens to choose)",
        budget / GiB, 100 * CPU_KV_MEMORY_FRACTION, available / GiB,
        f", / {num_ranks} TP ranks" if num_ranks > 1 else "",
        f", shared 1 : {tier_ratio:g} with the host tier (--hicache-ratio)" if tier_ratio else "",
    )  # fmt: skip
    return budget
