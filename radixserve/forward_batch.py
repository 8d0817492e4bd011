"""ForwardBatch: what one model forward computes, passed explicitly to every layer.

A batch is a list of requests, each contributing `extend_len` new tokens on top of
`prefix_len` tokens whose K/V already sit in the pool. A decode token is an extend of
length 1; a fresh prefill has prefix_len 0; a cache hit has prefix_len > 0. Tokens of all
requests are flattened, request by request:

    input_ids:  [r0 t0, r0 t1, r0 t2 | r1 t0 | r2 t0, r2 t1]     extend_lens = [3, 1, 2]
    positions:  [p0, p0+1, p0+2      | p1    | p2, p2+1]         p_i = prefix_lens[i]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class LoraBatch:
    """Which tokens use which LoRA adapter slot, grouped once per step (model/lora.py).

    `rows` lists the adapter tokens' rows grouped by slot; segment (slot, start, end) is
    `rows[start:end]`. `every_row`: one adapter holds every token, in order (no gather)."""

    segments: tuple[tuple[int, int, int], ...]  # (slot, start, end) into rows; slots unique
    rows: torch.Tensor  # [num adapter tokens] int64, grouped by slot
    every_row: bool = False

    @classmethod
    def build(cls, slot_per_token: np.ndarray, device: torch.device | str) -> LoraBatch | None:
        """From each token's slot (-1: the base model); None when no token uses an adapter."""
        slots = np.unique(slot_per_token[slot_per_token >= 0])
        if not len(slots):
            return None
        groups = [np.flatnonzero(slot_per_token == slot) for slot in slots]
        ends = np.cumsum([len(g) for g in groups])
        segments = tuple((int(s), int(e - len(g)), int(e)) for s, g, e in zip(slots, groups, ends))
        every_row = len(groups) == 1 and len(groups[0]) == len(slot_per_token)
        return cls(segments, torch.from_numpy(np.concatenate(groups)).to(device), every_row)

    @cached_property
    def offsets(self) -> torch.Tensor:
        """[num segments + 1] int64 on rows' device: segment s is rows[offsets[s]:offsets[s+1]]
        (the segmented LoRA kernels' input, made once per batch)."""
        ends = [0, *(end for _, _, end in self.segments)]
        return torch.tensor(ends, dtype=torch.int64).to(self.rows.device)

    @cached_property
    def slot_ids(self) -> torch.Tensor:
        """[num segments] int64 on rows' device: each segment's pool slot."""
        slots = [slot for slot, _, _ in self.segments]
        return torch.tensor(slots, dtype=torch.int64).to(self.rows.device)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_slots: torch.Tensor  # [num_tokens] int64: pool slot that receives each token's K/V
    page_table: torch.Tensor  # [num_reqs, max_pages] int64, padded with page 0
    extend_lens: list[int]
    prefix_lens: list[int]
    page_size: int
    return_all_logits: bool = False
    return_hidden: bool = False  # LogitsOutput.hidden: embedding requests end in this batch
    verify_indices: torch.Tensor | None = None  # [num_verify_rows] int64: tokens that need logits
    attn_metadata: Any = field(default=None, repr=False)  # set by the attention backend
    lora: LoraBatch | None = None  # tokens per LoRA adapter; None: all on the base model
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    """Requests that verify a draft tree (speculative decoding): request index -> [extend_len,
    extend_len] bool, which of its own new tokens each new token attends to (True: attend;
    all of its cached prefix too). Absent: plain causal."""

    @property
    def num_reqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        page_size: int,
        device: torch.device | str = "cpu",
        return_all_logits: bool = False,
        verify_indices: Sequence[int] = (),
        return_hidden: bool = False,
        tree_parents: Sequence[Sequence[int] | None] = (),
    ) -> ForwardBatch:
        """Flattens per-request new tokens; each page table (a list or numpy array of page
        ids) must cover prefix + new tokens. `verify_indices`: flattened tokens whose logits
        speculative decoding verifies (LogitsOutput.verify). `tree_parents[i]`: request i's
        new tokens end with a draft tree, node 0 its last sequence token and node j >= 1 a
        draft whose parent node is tree_parents[i][j - 1] (< j); its nodes sit at position
        root + depth and attend to their ancestors only (None or absent: a plain sequence)."""
        if not (len(token_ids) == len(prefix_lens) == len(page_tables)) or not token_ids:
            raise ValueError(
                "token_ids, prefix_lens and page_tables must be equal, non-empty lists"
            )
        extend_lens = [len(t) for t in token_ids]
        if min(extend_lens) < 1:
            raise ValueError("every request in a batch needs at least one new token")
        num_pages = [len(pages) for pages in page_tables]
        for i, (pre, ext, num) in enumerate(zip(prefix_lens, extend_lens, num_pages)):
            if num * page_size < pre + ext:
                raise ValueError(
                    f"request {i}: page table holds {num * page_size} tokens, needs {pre + ext}"
                )
        table = _pad_rows(page_tables, num_pages)
        positions, out_slots = _positions_and_slots(extend_lens, prefix_lens, table, page_size)
        input_ids = np.fromiter(chain.from_iterable(token_ids), np.int64, len(positions))
        tree_masks = _apply_trees(tree_parents, extend_lens, positions)
        return cls(
            input_ids=torch.from_numpy(input_ids).to(device),
            positions=torch.from_numpy(positions).to(device),
            out_slots=torch.from_numpy(out_slots).to(device),
            page_table=torch.from_numpy(table).to(device),
            extend_lens=extend_lens,
            prefix_lens=list(prefix_lens),
            page_size=page_size,
            return_all_logits=return_all_logits,
            return_hidden=return_hidden,
            verify_indices=(
                torch.tensor(verify_indices, dtype=torch.int64).to(device)
                if verify_indices
                else None
            ),
            tree_masks={i: torch.from_numpy(m).to(device) for i, m in tree_masks.items()},
        )

    def last_token_indices(self) -> torch.Tensor:
        """Index into the flattened tokens of each request's last new token. [num_reqs]"""
        ends = torch.cumsum(torch.tensor(self.extend_lens, dtype=torch.int64), 0) - 1
        return ends.to(self.input_ids.device)


def _pad_rows(rows: Sequence[Sequence[int]], lens: list[int]) -> np.ndarray:
    """The rows left-aligned in one [num_rows, max_len] int64 array, padded with page 0.
    Numpy (here and below) copies rows and runs small ops several times faster than torch."""
    table = np.zeros((len(rows), max(lens)), dtype=np.int64)
    for i, (row, num) in enumerate(zip(rows, lens)):
        table[i, :num] = row
    return table


def _positions_and_slots(
    extend_lens: list[int], prefix_lens: Sequence[int], table: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each new token's position and the pool slot its K/V goes to. Both [num_tokens] int64."""
    ext = np.asarray(extend_lens, dtype=np.int64)
    req_of_token = np.repeat(np.arange(len(ext)), ext)
    starts = np.cumsum(ext) - ext
    offsets = np.arange(int(ext.sum())) - starts[req_of_token]
    positions = np.asarray(prefix_lens, dtype=np.int64)[req_of_token] + offsets
    out_slots = table[req_of_token, positions // page_size] * page_size + positions % page_size
    return positions, out_slots


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth in a draft tree (node 0, the root, at 0; node j's parent
    parents[j - 1] < j)."""
    depths = [0]
    for j, parent in enumerate(parents, start=1):
        if not 0 <= parent < j:
            raise ValueError(f"tree node {j}: parent {parent} is not an earlier node")
        depths.append(depths[parent] + 1)
    return depths


def tree_ancestors(parents: Sequence[int]) -> np.ndarray:
    """[N + 1, N + 1] bool: node i attends to node j (j is i or an ancestor of i)."""
    num = len(parents) + 1
    mask = np.eye(num, dtype=bool)
    for j, parent in enumerate(parents, start=1):
        mask[j] |= mask[parent]
    return mask


def _apply_trees(
    tree_parents: Sequence[Sequence[int] | None], extend_lens: list[int], positions: np.ndarray
) -> dict[int, np.ndarray]:
    """Moves each tree's nodes to position root + depth (in place) and returns each tree
    request's [extend_len, extend_len] attention mask over its new tokens."""
    masks, start = {}, 0
    for i, ext in enumerate(extend_lens):
        parents = tree_parents[i] if i < len(tree_parents) else None
        if parents is not None:
            num = len(parents) + 1
            if num > ext:
                raise ValueError(f"request {i}: a tree of {num} nodes in {ext} new tokens")
            first = start + ext - num  # the root's index in the batch
            depths = np.asarray(tree_depths(parents), dtype=np.int64)
            positions[first : first + num] = positions[first] + depths
            mask = np.tril(np.ones((ext, ext), dtype=bool))
            mask[ext - num :, ext - num :] = tree_ancestors(parents)
            masks[i] = mask
        start += ext
    return masks
