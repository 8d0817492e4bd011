"""flashinfer: FlashInfer's paged attention kernels (CUDA only; `pip install flashinfer-python`).

One layer of our pool, k[layer]: [num_pages * page_size, kv_heads, head_dim], viewed as
[num_pages, page_size, kv_heads, head_dim] is FlashInfer's "NHD" paged layout, so its kernels
read the pool in place. They find each request's K/V through CSR page lists built from the
batch's page table (`paged_kv_plan_inputs`), e.g. page_size 4, seq_lens [5, 2]:

    page_table [[7, 3], [9, 0]]  ->  kv_indptr [0, 2, 3]   kv_indices [7, 3, 9]
                                     kv_last_page_len [1, 2]   (tokens in the last page, 1..4)

Pure-decode batches go through the decode wrapper (tensor cores for GQA groups >= 4); batches
with any extend through the paged prefill wrapper with causal=True, whose mask is aligned to the
end of each request's KV, so new tokens see their cached prefix in full. FlashInfer's
`window_left` counts the keys left of the query, ours the whole window: window_left = window - 1.
New K/V are written into the pool first (index_copy_), then `plan` once per batch, `run` per layer.

A batch with draft trees (`batch.tree_masks`, EAGLE3 tree verification) plans the prefill
wrapper with `custom_mask` (FlashInfer's flattened [qo_len, kv_len] bool per request, causal
off): every request's torch_native mask (`extend_mask`), the window in it, window_left -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.torch_native import extend_mask
from radixserve.cache.kv_pool import KVPool
from radixserve.forward_batch import ForwardBatch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace, shared by all wrappers
TENSOR_CORE_MIN_GROUP = 4  # query heads per KV head from which the tensor-core decode pays


class PagedKVPlanInputs(NamedTuple):
    """What FlashInfer's `plan` reads: host-side pointers, device-side page ids."""

    qo_indptr: torch.Tensor  # [num_reqs + 1] int32, cpu: each request's first new token
    kv_indptr: torch.Tensor  # [num_reqs + 1] int32, cpu: each request's first entry of kv_indices
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, on the page table's device
    kv_last_page_len: torch.Tensor  # [num_reqs] int32, cpu: tokens in each last page


def paged_kv_plan_inputs(
    page_table: torch.Tensor,
    seq_lens: Sequence[int],
    extend_lens: Sequence[int],
    page_size: int,
) -> PagedKVPlanInputs:
    """CSR page lists of a batch: row i uses page_table[i, :ceil(seq_lens[i] / page_size)]."""
    num_pages = [-(-n // page_size) for n in seq_lens]
    kv_indptr = _indptr(num_pages)
    last = [n - (p - 1) * page_size for n, p in zip(seq_lens, num_pages)]
    return PagedKVPlanInputs(
        qo_indptr=_indptr(extend_lens),
        kv_indptr=kv_indptr,
        kv_indices=_gather_pages(page_table, num_pages, int(kv_indptr[-1])),
        kv_last_page_len=torch.tensor(last, dtype=torch.int32),
    )


def _indptr(counts: Sequence[int]) -> torch.Tensor:
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(list(counts), dtype=torch.int64).cumsum(0)
    return indptr


def _gather_pages(page_table: torch.Tensor, num_pages: list[int], total: int) -> torch.Tensor:
    """page_table[i, :num_pages[i]] of every row, concatenated, on the table's device.

    `total` is known on the host, so nothing here waits for the device (no boolean masks)."""
    device = page_table.device
    counts = torch.tensor(num_pages, device=device)
    rows = torch.repeat_interleave(
        torch.arange(len(num_pages), device=device), counts, output_size=total
    )
    starts = torch.cumsum(counts, 0) - counts
    cols = torch.arange(total, device=device) - starts[rows]
    return page_table[rows, cols].to(torch.int32)


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's `window_left` (keys left of the query, -1: none) for our window (all keys)."""
    return -1 if sliding_window is None else sliding_window - 1


def tree_batch_mask(batch: ForwardBatch, sliding_window: int | None) -> torch.Tensor:
    """FlashInfer's `custom_mask` for a batch with draft trees: each request's [extend_len,
    seq_len] mask (torch_native's, trees and window in it), flattened and concatenated."""
    starts = [0]
    for ext in batch.extend_lens:
        starts.append(starts[-1] + ext)
    return torch.cat(
        [
            extend_mask(batch, i, starts[i], sliding_window).reshape(-1)
            for i in range(batch.num_reqs)
        ]
    )


def import_flashinfer() -> Any:
    """The flashinfer module, or an error that says how to get it or what to use instead."""
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(
            "attention_backend='flashinfer' needs the flashinfer package "
            "(pip install flashinfer-python; CUDA only); or use --attention-backend triton"
        ) from exc
    return flashinfer


class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_tree_mask = True

    def __init__(self, pool: KVPool, num_heads: int, sliding_window: int | None = None):
        super().__init__(pool, sliding_window)
        if pool.device.type != "cuda":
            raise ValueError(
                f"attention_backend='flashinfer' runs on CUDA only (the KV pool is on "
                f"{pool.device}); use attention_backend='torch_native' or 'triton'"
            )
        if pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"attention_backend='flashinfer' needs a float16 or bfloat16 model (got "
                f"{pool.dtype}); use --dtype bfloat16 or attention_backend='triton'"
            )
        self._flashinfer = import_flashinfer()
        self.num_heads = num_heads
        self.use_tensor_cores = num_heads // pool.shape.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self.decode_wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.prefill_wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD"
        )
        self.graph_wrappers: dict[int, Any] = {}  # captured batch size -> its decode wrapper

    def init_forward(self, batch: ForwardBatch) -> None:
        inputs = paged_kv_plan_inputs(
            batch.page_table, batch.seq_lens, batch.extend_lens, batch.page_size
        )
        if max(batch.extend_lens) == 1:
            self._plan_decode(self.decode_wrapper, inputs)
            batch.attn_metadata = self.decode_wrapper
            return
        shape, masks = self.pool.shape, {}
        if batch.tree_masks:
            masks = {"custom_mask": tree_batch_mask(batch, self.sliding_window), "causal": False}
            masks |= {"window_left": -1}  # the window is in the mask, along each tree path
        self.prefill_wrapper.plan(
            inputs.qo_indptr, inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len,
            self.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size,
            **({"causal": True} | self._plan_kwargs() | masks),
        )  # fmt: skip
        batch.attn_metadata = self.prefill_wrapper

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer, batch.out_slots, k, v)
        shape = self.pool.shape
        pages = (-1, shape.page_size, shape.num_kv_heads, shape.head_dim)
        k_pool, v_pool = self.pool.layer_kv(layer)
        return batch.attn_metadata.run(q.contiguous(), (k_pool.view(pages), v_pool.view(pages)))

    # ---- CUDA graphs: one decode wrapper per captured size, over buffers of its own --------

    def plan_graph_decode(self, batch: ForwardBatch, seq_lens: Sequence[int]) -> None:
        num_reqs, max_pages = batch.page_table.shape
        inputs = paged_kv_plan_inputs(batch.page_table, seq_lens, [1] * num_reqs, batch.page_size)
        self._plan_decode(self._graph_wrapper(num_reqs, max_pages), inputs)

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        batch.attn_metadata = self.graph_wrappers[seq_lens.shape[0]]

    def _graph_wrapper(self, num_reqs: int, max_pages: int) -> Any:
        if num_reqs not in self.graph_wrappers:
            device = self.pool.device
            self.graph_wrappers[num_reqs] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(num_reqs + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(
                    num_reqs * max_pages, dtype=torch.int32, device=device
                ),
                paged_kv_last_page_len_buffer=torch.zeros(num_reqs, dtype=torch.int32,
                                                          device=device),
            )  # fmt: skip
        return self.graph_wrappers[num_reqs]

    def _plan_decode(self, wrapper: Any, inputs: PagedKVPlanInputs) -> None:
        shape = self.pool.shape
        wrapper.plan(
            inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len,
            self.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size,
            **self._plan_kwargs(),
        )  # fmt: skip

    def _plan_kwargs(self) -> dict[str, Any]:
        return {
            "pos_encoding_mode": "NONE",
            "window_left": window_left(self.sliding_window),
            "q_data_type": self.pool.dtype,
            "kv_data_type": self.pool.dtype,
        }
