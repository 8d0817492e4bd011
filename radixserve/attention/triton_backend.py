"""triton: the GPU attention backend over the paged pool (kernels in radixserve_kernels).

Pure-decode batches use the split-K decode kernel; batches with any extend (and sliding-
window models) use the extend kernel, which also covers decode tokens as extends of one.
Runs on CPU too under TRITON_INTERPRET=1, which is how CI checks it against torch_native.
Draft trees (`batch.tree_masks`, EAGLE3 tree verification) go to the extend kernel with their
ancestor masks (radixserve_kernels.paged_extend.TreeMasks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixserve_kernels.paged_extend import TreeMasks

SPLIT_LEN = 256  # positions per decode chunk (the kernel's default)
MAX_GRAPH_SPLITS = 64  # under CUDA graphs: longer contexts get longer chunks, not more of them


@dataclass
class _Metadata:
    use_decode_kernel: bool
    seq_lens: torch.Tensor  # [num_reqs]
    q_starts: torch.Tensor  # [num_reqs] first token of each request in the batch
    prefix_lens: torch.Tensor  # [num_reqs]
    extend_lens: torch.Tensor  # [num_reqs]
    max_extend_len: int
    num_splits: int | None = None  # decode chunks; None: from the longest sequence (host sync)
    split_len: int = SPLIT_LEN
    trees: TreeMasks | None = None  # draft trees' ancestor masks; None: none in the batch


def graph_decode_splits(num_positions: int) -> tuple[int, int]:
    """(num_splits, split_len) covering `num_positions` with a fixed chunk count."""
    num_splits = min(-(-num_positions // SPLIT_LEN), MAX_GRAPH_SPLITS)
    split_len = -(-num_positions // num_splits)
    return num_splits, -(-split_len // 32) * 32  # whole blocks of the kernel's BLOCK_N


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_tree_mask = True

    def __init__(self, pool, sliding_window: int | None = None, logit_cap: float | None = None):
        super().__init__(pool, sliding_window, logit_cap)
        from radixserve_kernels import kv_store, paged_decode, paged_extend

        self._store_kv = kv_store.store_kv
        self._decode = paged_decode.paged_decode_attention
        self._extend = paged_extend.paged_extend_attention
        self._tree_masks = paged_extend.TreeMasks.build

    def init_forward(self, batch: ForwardBatch) -> None:
        device = batch.page_table.device
        extend = torch.tensor(batch.extend_lens, dtype=torch.int64, device=device)
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=device)
        max_extend = max(batch.extend_lens)
        batch.attn_metadata = _Metadata(
            use_decode_kernel=max_extend == 1 and self.sliding_window is None,
            seq_lens=prefix + extend,
            q_starts=torch.cumsum(extend, 0) - extend,
            prefix_lens=prefix,
            extend_lens=extend,
            max_extend_len=max_extend,
            trees=(
                self._tree_masks(batch.tree_masks, batch.extend_lens, device)
                if batch.tree_masks
                else None
            ),
        )

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        num_splits, split_len = graph_decode_splits(batch.page_table.shape[1] * batch.page_size)
        ones = torch.ones_like(seq_lens)
        batch.attn_metadata = _Metadata(
            use_decode_kernel=self.sliding_window is None,
            seq_lens=seq_lens,
            q_starts=torch.cumsum(ones, 0) - ones,
            prefix_lens=seq_lens - ones,
            extend_lens=ones,
            max_extend_len=1,
            num_splits=num_splits,
            split_len=split_len,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        k_pool, v_pool = self.pool.layer_kv(layer)
        self._store_kv(k.contiguous(), v.contiguous(), k_pool, v_pool, batch.out_slots)
        meta: _Metadata = batch.attn_metadata
        if meta.use_decode_kernel:
            return self._decode(
                q, k_pool, v_pool, batch.page_table, meta.seq_lens, batch.page_size,
                split_len=meta.split_len, num_splits=meta.num_splits, logit_cap=self.logit_cap,
            )  # fmt: skip
        return self._extend(
            q, k_pool, v_pool, batch.page_table, meta.q_starts, meta.prefix_lens,
            meta.extend_lens, meta.max_extend_len, batch.page_size,
            sliding_window=self.sliding_window, trees=meta.trees, logit_cap=self.logit_cap,
        )  # fmt: skip
