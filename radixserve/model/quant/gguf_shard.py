"""A tensor-parallel rank's part of a GGUF projection, cut from its blocks (no fp copy).

    column-parallel (q/k/v, gate/up, the LM head)   whole rows: each row's blocks as they are
    row-parallel (o_proj, down_proj)                whole blocks of every row's inputs: the
                                                    rank's columns must start and end on a
                                                    block (32 inputs; 256 for K-quants)

Rows are cut after llama.cpp's q/k permutation is undone (gguf_weights.layer_weight), so a
rank takes its heads in HF order, as from a safetensors checkpoint (model/tp_shard.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.model.quant.kquant import KQUANT_TYPES
from radixserve.model.source import ModelLoadError

if TYPE_CHECKING:
    from radixserve.model.quant.gguf_blocks import BlockWeight
    from radixserve.model.tp_shard import ShardLayout

GGUF_BLOCK = 32  # inputs per Q4_0 / Q4_1 / Q8_0 block (gguf_weights.GGUF_BLOCK)
KQUANT_BLOCK = 256  # inputs per K-quant super-block


def shard_weight(weight: BlockWeight, hf_name: str, layout: ShardLayout | None) -> BlockWeight:
    """This rank's part of `weight` (HF name `hf_name`); the whole of it without TP."""
    index = None if layout is None else layout.hf_index(hf_name)
    if index is None:
        return weight
    dim, start, stop = index
    if dim == 0:
        return weight.take_rows(torch.arange(start, stop))
    return _take_columns(weight, start, stop, layout.size, hf_name)


def _take_columns(
    weight: BlockWeight, start: int, stop: int, num_ranks: int, what: str
) -> BlockWeight:
    kind = weight.kind
    if kind == "fp":
        return weight._replace(values=weight.values[:, start:stop])
    block = KQUANT_BLOCK if kind in KQUANT_TYPES else GGUF_BLOCK
    if start % block or stop % block:
        raise ModelLoadError(
            f"--tp-size {num_ranks}: {what} splits into {stop - start} input columns per rank, "
            f"which cut its {kind} blocks of {block} inputs; use a --tp-size that leaves "
            f"whole blocks (or --quantization none)"
        )
    if kind in KQUANT_TYPES:  # [rows, bytes]: super-blocks of bytes_per_block
        bytes_per_block = KQUANT_TYPES[kind][1]
        first, last = start // block * bytes_per_block, stop // block * bytes_per_block
        return weight._replace(values=weight.values[:, first:last])
    groups = slice(start // block, stop // block)
    zeros = None if weight.zeros is None else weight.zeros[:, groups]
    return weight._replace(
        values=weight.values[:, start:stop], scales=weight.scales[:, groups], zeros=zeros
    )


def shard_head(weight: BlockWeight, layout: ShardLayout | None) -> BlockWeight:
    """The LM head's vocab rows this rank holds (vocab-parallel)."""
    if layout is None or layout.size == 1:
        return weight
    start = layout.vocab_start
    return weight.take_rows(torch.arange(start, start + layout.vocab_size))
