"""A token embedding whose table stays in GGUF blocks (`BlockEmbedding`).

A GGUF stores token_embd as Q4_0 ... Q6_K blocks like any projection. Instead of an fp copy of
the whole table (Llama 3's 128256 x 4096 in fp32: 2 GB, 8x the Q4_K bytes), each lookup
dequantizes only its tokens' rows from a block layer's weight (`dequantize_rows`): the LM head
itself where the embedding is tied (no second copy), else a layer over token_embd's blocks
(a K-quant one is a view of the mapped file). The rows are the values the fp table held: the
same dequantization.

Under tensor parallelism the table holds this rank's vocab rows, looked up as
layers.VocabParallelEmbedding does (ids outside them give zeros, an all-reduce assembles).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.distributed.group import TPGroup
from radixserve.model.quant.base_linear import QuantizedLinear


class BlockEmbedding(nn.Module):
    """ids -> rows [*ids.shape, hidden] in `dtype`, dequantized from `table`'s blocks per
    lookup. `table` is a block layer ([vocab rows, hidden]) with `dequantize_rows`; a tied
    model's LM head is the same module (nn.Module shares it: one copy, listed once)."""

    def __init__(self, table: QuantizedLinear, vocab_start: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        if not hasattr(table, "dequantize_rows"):
            raise TypeError(f"BlockEmbedding: {type(table).__name__} has no dequantize_rows")
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.vocab_start, self.tp, self.dtype = vocab_start, tp, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.table
        if self.tp.size == 1:
            flat = ids.reshape(-1)
            return table.dequantize_rows(flat).to(self.dtype).reshape(*ids.shape, -1)
        local = ids.reshape(-1) - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = table.dequantize_rows(local.masked_fill(outside, 0)).to(self.dtype)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0).reshape(*ids.shape, -1)
        return self.tp.all_reduce(rows)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}"
