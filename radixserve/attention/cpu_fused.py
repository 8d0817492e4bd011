"""cpu_fused: torch_native with its decode group replaced by the C++ paged decode kernel.

The kernel (csrc/paged_decode.cpp, built by cpu_extension.py) reads each decode request's
K/V pages in place from the pool: no per-layer gathered copy, no padding, no mask tensor.
Extend segments (prefill, cached-prefix extends) still take torch_native's SDPA path.
Pools of float32 or bfloat16 K/V, any query dtype (queries are read as float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.attention.cpu_extension import load_cpu_ops
from radixserve.attention.torch_native import TorchNativeBackend, _Metadata
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch

KV_DTYPES = (torch.float32, torch.bfloat16)
NO_WINDOW = -1  # the kernel's sliding_window argument when the model has none


@dataclass
class _FusedDecode:
    token_idx: torch.Tensor | None  # [num_decode]; None: every token of the batch, in order
    page_table: torch.Tensor  # [num_decode, max_pages] int64, contiguous
    seq_lens: torch.Tensor  # [num_decode] int64


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

    def _decode_group(
        self, batch: ForwardBatch, reqs: list[int], starts: list[int]
    ) -> _FusedDecode:
        lens = torch.tensor([batch.seq_lens[i] for i in reqs], dtype=torch.int64)
        if len(reqs) == batch.num_tokens:  # a pure decode batch: rows as they are
            return _FusedDecode(None, batch.page_table.contiguous(), lens)
        rows = batch.page_table[torch.tensor(reqs)]
        return _FusedDecode(torch.tensor([starts[i] for i in reqs]), rows, lens)

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        decode = _FusedDecode(None, batch.page_table.contiguous(), seq_lens.to(torch.int64))
        batch.attn_metadata = _Metadata(decode=decode, extends=[])

    def _forward_decode(
        self, q: torch.Tensor, layer: int, dec: _FusedDecode, page_size: int, out: torch.Tensor
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
        )
        if dec.token_idx is None:
            out.copy_(o)
        else:
            out[dec.token_idx] = o.to(out.dtype)
