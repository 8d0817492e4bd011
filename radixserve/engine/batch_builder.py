"""BatchBuilder: one step's work as a ForwardBatch, converting each request's page table only
when it changed (a decoding request's grows by one page every page_size steps)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.engine.logprobs import needs_all_logits
from radixserve.engine.request import Req
from radixserve.forward_batch import ForwardBatch, LoraBatch

_NO_ROW = (None, 0, None)


@dataclass
class Work:
    """What one request computes in this step: `num_new` tokens of its sequence, then the
    draft tokens it verifies (speculative decoding; their K/V is kept only if accepted)."""

    req: Req
    num_new: int
    draft: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(draft), vocab] q of a sampled draft
    draft_parents: list[int] | None = None  # a draft tree's parents (Draft.parents); None: chain
    draft_source: str | None = None  # the algorithm that proposed the draft

    @property
    def num_forward(self) -> int:
        """Tokens this request puts into the forward."""
        return self.num_new + len(self.draft)


class BatchBuilder:
    """`lora`: the model's LoRA weights and adapter pool (model/lora.py `LoraWeights`); None
    without LoRA."""

    def __init__(self, page_size: int, device: torch.device, lora=None):
        self.page_size, self.device = page_size, device
        self.lora = lora
        self._page_row_memo: dict[Req, tuple[list[int], int, np.ndarray]] = {}

    def build(self, work: list[Work], running: Sequence[Req] = ()) -> ForwardBatch:
        """Each request's new tokens on top of its computed prefix, through its page table;
        the adapters of `work` put in the LoRA pool first, never evicting one of `running`'s."""
        batch = self._build_base(work)
        needed = {w.req.lora_id for w in work if w.req.lora_id is not None}
        if self.lora is not None and needed:
            in_use = {r.lora_id for r in running if r.lora_id is not None}
            self.lora.activate(needed, in_use)
            batch.lora = self._lora_batch(work)
        return batch

    def _lora_batch(self, work: list[Work]) -> LoraBatch | None:
        """The batch's tokens grouped by adapter slot, once per step (-1: the base)."""
        # Intake refuses requests of unloaded adapters, unload refuses while one of the
        # adapter's requests is in the engine, and activate() gave each adapter a slot
        slot_of = self.lora.slot_of_id
        slots = np.array([-1 if w.req.lora_id is None else slot_of[w.req.lora_id]
                          for w in work])  # fmt: skip
        counts = np.array([w.num_forward for w in work])
        return LoraBatch.build(np.repeat(slots, counts), self.device)

    def _build_base(self, work: list[Work]) -> ForwardBatch:
        return ForwardBatch.build(
            [token_slice(w.req, w.req.num_computed, w.num_new) + w.draft for w in work],
            [w.req.num_computed for w in work],
            self._page_rows([w.req for w in work]),
            self.page_size,
            self.device,
            return_all_logits=any(needs_all_logits(w.req) for w in work),
            verify_indices=verify_indices(work),
            return_hidden=any(w.req.embed for w in work),
            tree_parents=[w.draft_parents if w.draft else None for w in work],
        )

    def _page_rows(self, reqs: list[Req]) -> list[np.ndarray]:
        """Each request's page table as an array, converted again only when the table changed.

        Page tables are replaced, never edited in place, so the list object identifies its
        contents; requests that left the batch drop out of the memo.
        """
        memo, self._page_row_memo = self._page_row_memo, {}
        rows = []
        for req in reqs:
            table, num, row = memo.get(req, _NO_ROW)
            if table is not req.page_table or num != len(table):
                table, num = req.page_table, len(req.page_table)
                row = np.array(table, dtype=np.int64)
            self._page_row_memo[req] = (table, num, row)
            rows.append(row)
        return rows


def lora_of(runner):
    """The runner's LoRA weights (None without LoRA, or on a stand-in runner)."""
    return getattr(runner, "lora", None)


def verify_indices(work: list[Work]) -> list[int]:
    """Flattened indices of the verify rows (the last sequence token and the drafts) of the
    work that carries a draft, in batch order."""
    indices, start = [], 0
    for w in work:
        if w.draft:
            indices += range(start + w.num_new - 1, start + w.num_forward)
        start += w.num_forward
    return indices


def token_slice(req: Req, start: int, num: int) -> list[int]:
    """`req.seq_ids()[start : start + num]`, without copying the whole sequence."""
    end, num_input = start + num, len(req.input_ids)
    if end <= num_input:
        return req.input_ids[start:end]
    if start >= num_input:
        return req.output_ids[start - num_input : end - num_input]
    return req.input_ids[start:] + req.output_ids[: end - num_input]
