"""A ForwardBatch sent from rank 0 to the other tensor-parallel ranks.

A small header (six ints) travels over each local worker's pipe, which also wakes it (to the
leaders of other nodes: over the group's `headers` broadcast, as an int64 tensor); the token
ids, positions, slots, page table, and the pages to zero before use travel as one int64
tensor broadcast over the group (on the device, for nccl):

    payload = [extend_lens | prefix_lens | input_ids | positions | out_slots | page_table
               | new_pages]        (num_reqs, num_reqs, num_tokens x 3, num_reqs x max_pages,
                                    num_new_pages)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixserve.distributed.group import TPGroup
from radixserve.forward_batch import ForwardBatch


class BatchHeader(NamedTuple):
    num_reqs: int
    num_tokens: int
    max_pages: int
    page_size: int
    return_all_logits: bool
    num_new_pages: int  # pages handed out for the first time: zeroed before the forward


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


def pack_batch(batch: ForwardBatch, new_pages: torch.Tensor) -> tuple[BatchHeader, torch.Tensor]:
    device = batch.input_ids.device
    lens = torch.tensor([*batch.extend_lens, *batch.prefix_lens], dtype=torch.int64)
    parts = [
        lens.to(device),
        batch.input_ids,
        batch.positions,
        batch.out_slots,
        batch.page_table.flatten(),
        new_pages.to(device),
    ]
    header = BatchHeader(
        num_reqs=batch.num_reqs,
        num_tokens=batch.num_tokens,
        max_pages=int(batch.page_table.shape[1]),
        page_size=batch.page_size,
        return_all_logits=batch.return_all_logits,
        num_new_pages=int(new_pages.numel()),
    )
    return header, torch.cat(parts)


def receive_batch(
    header: BatchHeader, tp: TPGroup, device: torch.device
) -> tuple[ForwardBatch, torch.Tensor]:
    """The batch rank 0 broadcasts after sending `header`, and the pages to zero first."""
    r, t, p = header.num_reqs, header.num_tokens, header.max_pages
    size = 2 * r + 3 * t + r * p + header.num_new_pages
    payload = tp.broadcast(torch.empty(size, dtype=torch.int64, device=device))
    lens, ids, positions, slots, table, new_pages = payload.split(
        [2 * r, t, t, t, r * p, header.num_new_pages]
    )
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
    return batch, new_pages
