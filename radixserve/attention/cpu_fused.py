"""cpu_fused: torch_native with decodes and cached-prefix extends run by C++ kernels.

Both kernels (native/csrc/, built by native/extension.py) read K/V pages in place from the
pool, once the layer's new K/V are in it: no per-layer gathered copy, no padding, no mask tensor.
- decode tokens (extend_len 1): paged_decode, one query per request;
- extends over a cached prefix that `extend_in_place` routes to it: paged_extend, which
  tiles a request's new tokens so each prefix K/V row is loaded once per tile;
- the other extends (fresh prefills, and what the rule leaves) keep torch_native's SDPA.
Pools of float32 or bfloat16 K/V, any query dtype (queries are read as float32).

`deterministic` (--enable-deterministic-inference) routes every request, decodes and fresh
prefills included, to paged_extend (a fresh prefill reads its K/V back from the pool, as an
extend over an empty prefix): a query's row of that kernel is summed in the same order
whatever rows, tiles or requests share the call, so a token's attention output is bitwise
the same as a decode, a verify row, a cache-hit extend or a cold prefill chunk.

Draft trees (`batch.tree_masks`, EAGLE3 with --speculative-eagle-topk > 1) run in place too:
paged_extend takes each new token's parent (`tree_parents`, derived from the ancestor mask)
and attends each node as its root-to-node path would as a plain sequence, so under
`deterministic` a tree row is bitwise the chain's row as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.attention.torch_native import TorchNativeBackend, _Metadata
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch
from radixserve.native.extension import load_cpu_ops

KV_DTYPES = (torch.float32, torch.bfloat16)
NO_WINDOW = -1  # the kernel's sliding_window argument when the model has none
NO_CAP = 0.0  # the kernels' logit_cap argument when scores are not soft-capped


def extend_in_place(prefix_len: int, extend_len: int) -> bool:
    """Whether an extend of `extend_len` new tokens over `prefix_len` cached ones runs in
    place (paged_extend) rather than as gather + SDPA."""
    return prefix_len > 0


def tree_parents(batch: ForwardBatch, starts: list[int]) -> torch.Tensor:
    """Each token's parent among its request's new tokens (-1: the first): i - 1 in a plain
    sequence; in a draft tree its nearest ancestor in `batch.tree_masks` (an ancestor mask, as
    ForwardBatch.build makes: a node's ancestors all come before it, its parent last)."""
    ext = np.asarray(batch.extend_lens, dtype=np.int64)
    parents = np.arange(int(ext.sum()), dtype=np.int64) - np.repeat(starts[:-1], ext) - 1
    for req, mask in batch.tree_masks.items():
        strict = np.tril(mask.cpu().numpy(), -1)
        num = strict.shape[0]
        nearest = num - 1 - strict[:, ::-1].argmax(axis=1)
        start = starts[req]
        parents[start : start + num] = np.where(strict.any(axis=1), nearest, -1)
    return torch.from_numpy(parents)


@dataclass
class _FusedQueries:
    token_idx: torch.Tensor | None  # [num_queries]; None: every token of the batch, in order
    page_rows: torch.Tensor | None  # [num_queries] row of page_table; None: row i for query i
    page_table: torch.Tensor  # [num_rows, max_pages] int64, contiguous
    seq_lens: torch.Tensor  # [num_queries] int64: positions each query attends to


@dataclass
class _InPlaceExtends:
    """The extends paged_extend runs, all in one call; per-request tensors are [num_reqs]."""

    token_idx: torch.Tensor | None  # [their tokens] into the batch; None: every token, in order
    q_starts: torch.Tensor  # each request's first token in the batch
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    page_rows: torch.Tensor  # each request's row of page_table
    page_table: torch.Tensor  # [num_reqs_in_batch, max_pages] int64, contiguous
    tree_parents: torch.Tensor | None = None  # [batch tokens]: parent among its request's new
    # tokens (-1: the first); None when no request verifies a draft tree


@dataclass
class _FusedMetadata(_Metadata):
    in_place: _InPlaceExtends | None = None


class CpuFusedBackend(TorchNativeBackend):
    def __init__(
        self,
        pool: KVPool,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
        ops: Any = None,
        deterministic: bool = False,
    ):
        """`ops`: the loaded torch.ops namespace (default: build or load it now);
        `deterministic`: every query through paged_extend (batch-invariant attention);
        `logit_cap`: soft-capped scores (AttentionBackend), in the kernels too."""
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
        super().__init__(pool, sliding_window=sliding_window, logit_cap=logit_cap)
        self.ops = ops if ops is not None else load_cpu_ops()
        self._paged_decode = self.ops.paged_decode.default  # positional calls: less dispatch
        self.window = NO_WINDOW if sliding_window is None else sliding_window
        self.scale = 1.0 / math.sqrt(pool.shape.head_dim)  # SDPA's default, as torch_native
        self.cap = NO_CAP if logit_cap is None else float(logit_cap)
        self.route_extend: Callable[[int, int], bool] = extend_in_place
        self.deterministic = deterministic

    def init_forward(self, batch: ForwardBatch) -> None:
        starts = np.concatenate([[0], np.cumsum(batch.extend_lens)]).tolist()
        decode, in_place, sdpa = self._route(batch)
        batch.attn_metadata = _FusedMetadata(
            decode=self._decode_group(batch, decode, starts) if decode else None,
            extends=[self._extend_segment(batch, i, starts[i]) for i in sdpa],
            in_place=self._in_place_extends(batch, in_place, starts) if in_place else None,
        )

    def _route(self, batch: ForwardBatch) -> tuple[list[int], list[int], list[int]]:
        """The batch's requests by kernel: paged_decode, paged_extend, SDPA."""
        if self.deterministic:
            return [], list(range(batch.num_reqs)), []
        decode, in_place, sdpa = [], [], []
        for i, (p, e) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
            if i in batch.tree_masks:  # a draft tree: paged_extend with its parents
                in_place.append(i)
                continue
            group = decode if e == 1 else in_place if self.route_extend(p, e) else sdpa
            group.append(i)
        return decode, in_place, sdpa

    def _in_place_extends(
        self, batch: ForwardBatch, reqs: list[int], starts: list[int]
    ) -> _InPlaceExtends:
        ext = [batch.extend_lens[i] for i in reqs]
        every = len(reqs) == batch.num_reqs
        token_idx = None
        if not every:
            token_idx = torch.from_numpy(
                np.concatenate([np.arange(starts[i], starts[i] + e) for i, e in zip(reqs, ext)])
            )
        return _InPlaceExtends(
            token_idx=token_idx,
            q_starts=torch.tensor([starts[i] for i in reqs], dtype=torch.int64),
            prefix_lens=torch.tensor([batch.prefix_lens[i] for i in reqs], dtype=torch.int64),
            extend_lens=torch.tensor(ext, dtype=torch.int64),
            page_rows=torch.tensor(reqs, dtype=torch.int64),
            page_table=batch.page_table.contiguous(),
            tree_parents=tree_parents(batch, starts) if batch.tree_masks else None,
        )

    def forward_stored(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: _FusedMetadata = batch.attn_metadata
        if meta.decode is not None and meta.decode.token_idx is None:  # a pure decode batch
            return self._decode(q, layer, meta.decode, batch.page_size).to(q.dtype)
        out = torch.empty_like(q)
        self._forward_extends(q, k, v, layer, meta.extends, batch.page_size, out)
        if meta.in_place is not None:
            self._forward_in_place(q, layer, meta.in_place, batch.page_size, out)
        if meta.decode is not None:
            self._forward_decode(q, layer, meta.decode, batch.page_size, out)
        return out

    def _forward_in_place(
        self, q: torch.Tensor, layer: int, ext: _InPlaceExtends, page_size: int, out: torch.Tensor
    ) -> None:
        k_pool, v_pool = self.pool.layer_kv(layer)
        o = self.ops.paged_extend(
            q.float().contiguous(),
            k_pool,
            v_pool,
            page_table=ext.page_table,
            q_starts=ext.q_starts,
            prefix_lens=ext.prefix_lens,
            extend_lens=ext.extend_lens,
            page_rows=ext.page_rows,
            page_size=page_size,
            sliding_window=self.window,
            scale=self.scale,
            tree_parents=ext.tree_parents,
            logit_cap=self.cap,
        )
        if ext.token_idx is None:
            out.copy_(o)
        else:
            out[ext.token_idx] = o.to(out.dtype)

    def _decode_group(
        self, batch: ForwardBatch, reqs: list[int], starts: list[int]
    ) -> _FusedQueries:
        """One query per decode request (extend_len 1), through its own page-table row."""
        table = batch.page_table.contiguous()
        seq_lens = torch.tensor([batch.seq_lens[i] for i in reqs], dtype=torch.int64)
        if len(reqs) == batch.num_reqs:  # a pure decode batch
            return _FusedQueries(None, None, table, seq_lens)
        rows = torch.tensor(reqs, dtype=torch.int64)
        token_idx = torch.tensor([starts[i] for i in reqs], dtype=torch.int64)
        return _FusedQueries(token_idx, rows, table, seq_lens)

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        table = batch.page_table.contiguous()
        if self.deterministic:  # decodes as 1-token extends, as init_forward routes them
            rows, seq_lens = torch.arange(table.shape[0]), seq_lens.to(torch.int64)
            ones = torch.ones_like(seq_lens)
            in_place = _InPlaceExtends(None, rows, seq_lens - 1, ones, rows, table)
            batch.attn_metadata = _FusedMetadata(decode=None, extends=[], in_place=in_place)
            return
        queries = _FusedQueries(None, None, table, seq_lens.to(torch.int64))
        batch.attn_metadata = _FusedMetadata(decode=queries, extends=[])

    def _forward_decode(
        self, q: torch.Tensor, layer: int, dec: _FusedQueries, page_size: int, out: torch.Tensor
    ) -> None:
        """The decode tokens of a mixed batch (a pure decode batch returns `_decode` as is)."""
        out[dec.token_idx] = self._decode(q[dec.token_idx], layer, dec, page_size).to(out.dtype)

    def _decode(
        self, q: torch.Tensor, layer: int, dec: _FusedQueries, page_size: int
    ) -> torch.Tensor:
        """paged_decode of the decode queries `q` -> fp32 [num_queries, heads, head_dim]."""
        k_pool, v_pool = self.pool.layer_kv(layer)
        return self._paged_decode(
            q.float().contiguous(), k_pool, v_pool, dec.page_table, dec.seq_lens, page_size,
            self.window, self.scale, 0, dec.page_rows, self.cap,
        )  # fmt: skip
