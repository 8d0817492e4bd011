"""A ForwardBatch sent from rank 0 to the other tensor-parallel ranks.

A small header (eight ints) travels over each local worker's pipe, which also wakes it (to the
leaders of other nodes: over the group's `headers` broadcast, as an int64 tensor); the token
ids, positions, slots, page table, and rank 0's page bookkeeping since the last batch
(`PageUpdates`: pages to zero before use; with a sliding-window pool, the sliding-page table
entries it rewrote and the sliding pages to zero) travel as one int64 tensor broadcast over
the group (on the device, for nccl):

    payload = [extend_lens | prefix_lens | input_ids | positions | out_slots | page_table
               | new_pages | remapped pages | their sliding pages | new sliding pages]
              (num_reqs, num_reqs, num_tokens x 3, num_reqs x max_pages, num_new_pages,
               num_remapped x 2, num_new_sliding_pages)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.distributed.group import TPGroup
from radixserve.forward_batch import ForwardBatch


class BatchHeader(NamedTuple):
    num_reqs: int
    num_tokens: int
    max_pages: int
    page_size: int
    return_all_logits: bool
    num_new_pages: int  # pages handed out for the first time: zeroed before the forward
    num_remapped: int = 0  # sliding-page table entries rank 0 rewrote (cache/swa_pool.py)
    num_new_sliding_pages: int = 0  # sliding pages handed out for the first time


_NONE = torch.empty(0, dtype=torch.int64)


class PageUpdates(NamedTuple):
    """What rank 0's allocator did since the last batch that the other ranks' pools repeat."""

    new_pages: torch.Tensor = _NONE  # zero their K/V before use
    remapped: torch.Tensor = _NONE  # pages whose sliding page changed ...
    sliding: torch.Tensor = _NONE  # ... to these (0: tombstoned)
    new_sliding_pages: torch.Tensor = _NONE  # zero their sliding K/V before use

    def apply_to(self, pool: KVPool) -> None:
        """Repeats the updates on this rank's pool (a HybridKVPool when any are sliding)."""
        if self.new_pages.numel():
            pool.zero_pages(self.new_pages)
        if self.remapped.numel():
            pool.allocator.apply_changes(self.remapped, self.sliding)
        if self.new_sliding_pages.numel():
            pool.sliding.zero_pages(self.new_sliding_pages)


HEADER_LEN = len(BatchHeader._fields)
_SHUTDOWN = -1  # num_reqs of the header that tells other nodes to stop


def header_tensor(header: BatchHeader | None) -> torch.Tensor:
    """`header` as HEADER_LEN int64s on the CPU; None (stop) as a header of -1s."""
    if header is None:
        return torch.full((HEADER_LEN,), _SHUTDOWN, dtype=torch.int64)
    return torch.tensor([int(v) for v in header], dtype=torch.int64)


def header_from_tensor(values: torch.Tensor) -> BatchHeader | None:
    """The header `header_tensor` made, None for stop."""
    num_reqs, *rest = values.tolist()
    if num_reqs == _SHUTDOWN:
        return None
    header = BatchHeader(num_reqs, *rest)
    return header._replace(return_all_logits=bool(header.return_all_logits))


def pack_batch(batch: ForwardBatch, updates: PageUpdates) -> tuple[BatchHeader, torch.Tensor]:
    device = batch.input_ids.device
    lens = torch.tensor([*batch.extend_lens, *batch.prefix_lens], dtype=torch.int64)
    parts = [
        lens.to(device),
        batch.input_ids,
        batch.positions,
        batch.out_slots,
        batch.page_table.flatten(),
        *(part.to(device) for part in updates),
    ]
    header = BatchHeader(
        num_reqs=batch.num_reqs,
        num_tokens=batch.num_tokens,
        max_pages=int(batch.page_table.shape[1]),
        page_size=batch.page_size,
        return_all_logits=batch.return_all_logits,
        num_new_pages=int(updates.new_pages.numel()),
        num_remapped=int(updates.remapped.numel()),
        num_new_sliding_pages=int(updates.new_sliding_pages.numel()),
    )
    return header, torch.cat(parts)


def receive_batch(
    header: BatchHeader, tp: TPGroup, device: torch.device
) -> tuple[ForwardBatch, PageUpdates]:
    """The batch rank 0 broadcasts after sending `header`, and the page updates to apply
    before it runs."""
    r, t, p = header.num_reqs, header.num_tokens, header.max_pages
    sizes = [2 * r, t, t, t, r * p, header.num_new_pages]
    sizes += [header.num_remapped, header.num_remapped, header.num_new_sliding_pages]
    payload = tp.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=device))
    lens, ids, positions, slots, table, *updates = payload.split(sizes)
    lens = lens.tolist()
    batch = ForwardBatch(
        input_ids=ids,
        positions=positions,
        out_slots=slots,
        page_table=table.view(r, p),
        extend_lens=lens[:r],
        prefix_lens=lens[r:],
        page_size=header.page_size,
        return_all_logits=header.return_all_logits,
    )
    return batch, PageUpdates(*updates)
