"""cpu_fused: torch_native with its decode group replaced by the C++ paged decode kernel.

The kernel (csrc/paged_decode.cpp, built by cpu_extension.py) reads K/V pages in place from
the pool: no per-layer gathered copy, no padding, no mask tensor. Its queries are every
decode token and every token of a short extend over a cached prefix (up to
MAX_IN_PLACE_EXTEND tokens): each such token attends to the positions up to its own,
through its request's page-table row, once the layer's new K/V are in the pool. Longer
extends and fresh prefills keep torch_native's SDPA, whose matmuls win there.
Pools of float32 or bfloat16 K/V, any query dtype (queries are read as float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.attention.cpu_extension import load_cpu_ops
from radixserve.attention.torch_native import TorchNativeBackend, _Metadata
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch

KV_DTYPES = (torch.float32, torch.bfloat16)
NO_WINDOW = -1  # the kernel's sliding_window argument when the model has none
# Extends over a cached prefix up to this many tokens go through the kernel, one query per
# token (each reads the prefix again); longer ones through SDPA, whose one gather and
# matmuls are cheaper from 3 tokens on (measured, 1 thread, 1-16 requests x 128-4,096
# cached tokens: docs/performance.md, "CPU decode attention").
MAX_IN_PLACE_EXTEND = 2


@dataclass
class _FusedQueries:
    token_idx: torch.Tensor | None  # [num_queries]; None: every token of the batch, in order
    page_rows: torch.Tensor | None  # [num_queries] row of page_table; None: row i for query i
    page_table: torch.Tensor  # [num_rows, max_pages] int64, contiguous
    seq_lens: torch.Tensor  # [num_queries] int64: positions each query attends to


class CpuFusedBackend(TorchNativeBackend):
    def __init__(self, pool: KVPool, sliding_window: int | None = None, ops: Any = None):
        """`ops`: the loaded torch.ops namespace (default: build or load it now)."""
        if pool.device.type != "cpu":
            raise ValueError(
                f"attention_backend='cpu_fused' runs on CPU only (the KV pool is on "
                f"{pool.device}); use attention_backend='auto'"
            )
        if pool.dtype not in KV_DTYPES:
            raise ValueError(
                f"attention_backend='cpu_fused' reads float32 or bfloat16 K/V, not {pool.dtype}; "
                "use --kv-cache-dtype float32|bfloat16 or --attention-backend torch_native"
            )
        super().__init__(pool, sliding_window=sliding_window)
        self.ops = ops if ops is not None else load_cpu_ops()
        self.window = NO_WINDOW if sliding_window is None else sliding_window
        self.scale = 1.0 / math.sqrt(pool.shape.head_dim)  # SDPA's default, as torch_native
        self.max_in_place_extend = MAX_IN_PLACE_EXTEND

    def _in_decode_group(self, prefix_len: int, extend_len: int) -> bool:
        cached = prefix_len > 0 and extend_len <= self.max_in_place_extend
        return extend_len == 1 or cached

    def _decode_group(
        self, batch: ForwardBatch, reqs: list[int], starts: list[int]
    ) -> _FusedQueries:
        table = batch.page_table.contiguous()
        ext = np.asarray([batch.extend_lens[i] for i in reqs], dtype=np.int64)
        if len(reqs) == batch.num_reqs and (ext == 1).all():  # a pure decode batch
            return _FusedQueries(None, None, table, torch.tensor(batch.seq_lens))
        req_of_query = np.repeat(np.asarray(reqs, dtype=np.int64), ext)
        offsets = np.arange(int(ext.sum())) - np.repeat(np.cumsum(ext) - ext, ext)
        token_idx = np.asarray(starts, dtype=np.int64)[req_of_query] + offsets
        seq_lens = np.asarray(batch.prefix_lens, dtype=np.int64)[req_of_query] + offsets + 1
        every = len(token_idx) == batch.num_tokens
        return _FusedQueries(
            token_idx=None if every else torch.from_numpy(token_idx),
            page_rows=torch.from_numpy(req_of_query),
            page_table=table,
            seq_lens=torch.from_numpy(seq_lens),
        )

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        table = batch.page_table.contiguous()
        queries = _FusedQueries(None, None, table, seq_lens.to(torch.int64))
        batch.attn_metadata = _Metadata(decode=queries, extends=[])

    def _forward_decode(
        self, q: torch.Tensor, layer: int, dec: _FusedQueries, page_size: int, out: torch.Tensor
    ) -> None:
        k_pool, v_pool = self.pool.layer_kv(layer)
        qd = q if dec.token_idx is None else q[dec.token_idx]
        o = self.ops.paged_decode(
            qd.float().contiguous(),
            k_pool,
            v_pool,
            page_table=dec.page_table,
            seq_lens=dec.seq_lens,
            page_size=page_size,
            sliding_window=self.window,
            scale=self.scale,
            page_rows=dec.page_rows,
        )
        if dec.token_idx is None:
            out.copy_(o)
        else:
            out[dec.token_idx] = o.to(out.dtype)
