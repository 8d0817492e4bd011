"""torch_native: the reference attention backend, plain PyTorch SDPA over gathered pages.

Decode tokens (extend_len == 1) of all requests go through one padded SDPA call; each
extend segment gets its own call with a causal mask offset by its cached prefix. Slot
indices and masks are built once per batch and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackend
from radixserve.forward_batch import ForwardBatch


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor  # [num_decode] index into the batch's flattened tokens
    slots: torch.Tensor  # [num_decode, max_seq_len] pool slot of each position (0 where masked)
    mask: torch.Tensor  # [num_decode, 1, 1, max_seq_len] bool, True = attend


@dataclass
class _ExtendSegment:
    start: int  # first token of the segment in the flattened batch
    end: int
    slots: torch.Tensor | None  # [seq_len]; None: no cached prefix, attend to the fresh k/v
    mask: torch.Tensor | None  # [extend_len, seq_len] bool; None: plain causal


@dataclass
class _Metadata:
    decode: _DecodeGroup | None
    extends: list[_ExtendSegment]


def _slots_of(page_row: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slots of `positions` for request(s) whose pages are `page_row` ([..., max_pages])."""
    pages = page_row[..., positions // page_size]
    return pages * page_size + positions % page_size


class TorchNativeBackend(AttentionBackend):
    def init_forward(self, batch: ForwardBatch) -> None:
        decode_reqs = [i for i, e in enumerate(batch.extend_lens) if e == 1]
        starts = [0]
        for e in batch.extend_lens:
            starts.append(starts[-1] + e)
        extends = [
            self._extend_segment(batch, i, starts[i])
            for i, e in enumerate(batch.extend_lens)
            if e > 1
        ]
        decode = self._decode_group(batch, decode_reqs, starts) if decode_reqs else None
        batch.attn_metadata = _Metadata(decode=decode, extends=extends)

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        # Every row spans the page table's whole capacity (a static shape); the mask trims it.
        # This gathers max_pages * page_size positions per request, which is why the runner
        # does not capture torch_native on CUDA (supports_cuda_graph stays False); the graph
        # tests use it on CPU as the reference.
        num_positions = batch.page_table.shape[1] * batch.page_size
        token_idx = torch.arange(seq_lens.shape[0], device=seq_lens.device)
        decode = self._masked_decode(batch.page_table, seq_lens, num_positions, batch.page_size,
                                     token_idx)  # fmt: skip
        batch.attn_metadata = _Metadata(decode=decode, extends=[])

    def _decode_group(
        self, batch: ForwardBatch, reqs: list[int], starts: list[int]
    ) -> _DecodeGroup:
        device = batch.page_table.device
        lens = [batch.seq_lens[i] for i in reqs]
        rows = batch.page_table[torch.tensor(reqs, device=device)]
        token_idx = torch.tensor([starts[i] for i in reqs], device=device)
        seq_lens = torch.tensor(lens, device=device)
        return self._masked_decode(rows, seq_lens, max(lens), batch.page_size, token_idx)

    def _masked_decode(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        num_positions: int,
        page_size: int,
        token_idx: torch.Tensor,
    ) -> _DecodeGroup:
        """Slots of positions [0, num_positions) of each row's pages, masked to its length."""
        positions = torch.arange(num_positions, device=rows.device)
        valid = positions[None, :] < seq_lens[:, None]
        if self.sliding_window is not None:
            valid &= positions[None, :] > (seq_lens[:, None] - 1) - self.sliding_window
        slots = torch.where(valid, _slots_of(rows, positions, page_size), 0)
        return _DecodeGroup(token_idx=token_idx, slots=slots, mask=valid[:, None, None, :])

    def _extend_segment(self, batch: ForwardBatch, req: int, start: int) -> _ExtendSegment:
        prefix_len, extend_len = batch.prefix_lens[req], batch.extend_lens[req]
        end = start + extend_len
        if prefix_len == 0 and self.sliding_window is None:
            return _ExtendSegment(start, end, slots=None, mask=None)
        device = batch.page_table.device
        kv_pos = torch.arange(prefix_len + extend_len, device=device)
        q_pos = prefix_len + torch.arange(extend_len, device=device)[:, None]
        mask = kv_pos[None, :] <= q_pos
        if self.sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos - self.sliding_window
        slots = _slots_of(batch.page_table[req], kv_pos, batch.page_size) if prefix_len else None
        return _ExtendSegment(start, end, slots=slots, mask=mask)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer, batch.out_slots, k, v)
        k_pool, v_pool = self.pool.layer_kv(layer)
        meta: _Metadata = batch.attn_metadata
        out = torch.empty_like(q)
        for seg in meta.extends:
            if seg.slots is None:
                ks, vs = k[seg.start : seg.end], v[seg.start : seg.end]
            else:
                ks, vs = k_pool[seg.slots].to(q.dtype), v_pool[seg.slots].to(q.dtype)
            out[seg.start : seg.end] = _sdpa(q[seg.start : seg.end], ks, vs, seg.mask)
        if meta.decode is not None:
            dec = meta.decode
            qd = q[dec.token_idx].unsqueeze(2)  # [num_decode, num_heads, 1, head_dim]
            kd = k_pool[dec.slots].to(q.dtype).transpose(1, 2)  # [num_decode, kv_heads, len, dim]
            vd = v_pool[dec.slots].to(q.dtype).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec.mask, enable_gqa=True)
            out[dec.token_idx] = o.squeeze(2)
        return out


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """One sequence: q [n, heads, dim], k/v [len, kv_heads, dim] -> [n, heads, dim]."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1)
