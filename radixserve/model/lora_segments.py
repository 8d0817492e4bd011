"""Segmented LoRA kernels behind `LoraProjection.add_to`: one call adds every adapter's delta
on its own rows, in place of torch's gather, two matmuls per adapter and scatter-add.

    pool slot p of a projection, stacked once per change of the pool (`stack_slots`):
      at [P, K, Rp] = A_p^T,  bt [P, Rp, N] = B_p^T (scale in B),  ranks [P] (padded to 16)
    out[rows of segment s] += (x[rows] @ at[slot_s]) @ bt[slot_s]

CPU, fp32: native/csrc/lora_segments.cpp (one fixed FMA chain per output, so a row's result
does not depend on the batch), up to `LoraKernel.cpu_max_rows` adapter rows of a batch
(lora_choice.py measures where it beats torch); CUDA: the Triton kernel of
radixserve_kernels.lora_segments. Anything else (bf16 on CPU, more rows) keeps torch's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.forward_batch import LoraBatch

RANK_ALIGN = 16  # padded ranks: whole vectors on every SIMD level, whole tl.dot tiles
EVERY_ROW_COUNT = sys.maxsize  # cpu_max_rows meaning: the kernel at any row count


@dataclass(frozen=True)
class StackedLora:
    """A projection's pool slots in the kernels' layout (zeros where a slot has none)."""

    at: torch.Tensor  # [P, K, Rp]
    bt: torch.Tensor  # [P, Rp, N]
    ranks: torch.Tensor  # [P] int64: each slot's rank padded to RANK_ALIGN, 0: none


def stack_slots(weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> StackedLora:
    """slot -> (A [R, K], B [N, R]) as StackedLora over slots 0 .. max slot."""
    a0, b0 = next(iter(weights.values()))
    pool = max(weights) + 1
    padded = {slot: -(-a.shape[0] // RANK_ALIGN) * RANK_ALIGN for slot, (a, _) in weights.items()}
    rp = max(padded.values())
    at = a0.new_zeros(pool, a0.shape[1], rp)
    bt = b0.new_zeros(pool, rp, b0.shape[0])
    ranks = torch.zeros(pool, dtype=torch.int64)
    for slot, (a, b) in weights.items():
        at[slot, :, : a.shape[0]] = a.t()
        bt[slot, : a.shape[0]] = b.t()
        ranks[slot] = padded[slot]
    return StackedLora(at.contiguous(), bt.contiguous(), ranks.to(a0.device))


@dataclass(frozen=True)
class LoraKernel:
    """Which segmented kernel a projection's `add_to` may take: `cpu_ops` (the C++ op, fp32)
    for batches of up to `cpu_max_rows` adapter rows; `triton` on CUDA tensors."""

    cpu_ops: Any | None = None
    cpu_max_rows: int = 0
    triton: bool = False

    def takes(self, x: torch.Tensor, out: torch.Tensor, lora: LoraBatch) -> bool:
        """Whether this batch's projection runs on a segmented kernel."""
        if x.is_cuda:
            return self.triton
        return (
            self.cpu_ops is not None
            and lora.rows.numel() <= self.cpu_max_rows
            and x.dtype == out.dtype == torch.float32
            and x.is_contiguous()
            and out.is_contiguous()
        )

    def add(self, out: torch.Tensor, x: torch.Tensor, lora: LoraBatch, stacked: StackedLora):
        """out += each segment's delta, in place, on the kernel `takes` chose."""
        if x.is_cuda:
            from radixserve_kernels.lora_segments import segmented_lora

            longest = max(end - start for _, start, end in lora.segments)
            segmented_lora(out, x, lora.rows, lora.offsets, lora.slot_ids, stacked.ranks,
                           stacked.at, stacked.bt, longest)  # fmt: skip
            return
        self.cpu_ops.lora_segments_add(
            out, x, lora.rows, lora.offsets, lora.slot_ids, stacked.ranks, stacked.at, stacked.bt
        )
