"""torch_native: the reference attention backend, plain PyTorch SDPA over gathered pages.

Decode tokens (extend_len == 1) of all requests go through one padded SDPA call; each
extend segment gets its own call with a causal mask offset by its cached prefix. K/V are
gathered a whole page at a time; page lists and masks are built once per batch and shared by
all layers.
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
    pages: torch.Tensor  # [num_decode * num_pages] each request's first num_pages pages
    num_pages: int
    mask: torch.Tensor  # [num_decode, 1, 1, num_pages * page_size] bool, True = attend


@dataclass
class _ExtendSegment:
    start: int  # first token of the segment in the flattened batch
    end: int
    pages: torch.Tensor | None  # pages holding the whole sequence; None: no cached prefix,
    # attend to the fresh k/v only
    seq_len: int
    mask: torch.Tensor | None  # [extend_len, seq_len] bool; None: plain causal


@dataclass
class _Metadata:
    decode: _DecodeGroup | None
    extends: list[_ExtendSegment]


def extend_mask(
    batch: ForwardBatch, req: int, start: int, sliding_window: int | None
) -> torch.Tensor:
    """Request `req`'s [extend_len, seq_len] bool mask (True: attend; its new tokens start at
    `start` in the batch): causal over its prefix and new tokens, or for a draft tree
    (`batch.tree_masks`) the prefix and each node's ancestors, with the window counted along
    each node's path (nodes sit at root + depth: batch.positions)."""
    prefix_len, extend_len = batch.prefix_lens[req], batch.extend_lens[req]
    device = batch.page_table.device
    kv_pos = torch.arange(prefix_len + extend_len, device=device)
    q_pos = prefix_len + torch.arange(extend_len, device=device)[:, None]
    tree = batch.tree_masks.get(req)
    if tree is not None:
        new_pos = batch.positions[start : start + extend_len]
        kv_pos, q_pos = torch.cat([kv_pos[:prefix_len], new_pos]), new_pos[:, None]
    mask = kv_pos[None, :] <= q_pos
    if tree is not None:
        mask[:, prefix_len:] = tree
    if sliding_window is not None:
        mask &= kv_pos[None, :] > q_pos - sliding_window
    return mask


def _gather_pages(pool: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[num_slots, kv_heads, dim] pool -> [len(pages) * page_size, kv_heads, dim], whole pages
    at a time (one contiguous copy per page: much cheaper on CPU than a per-token gather)."""
    by_page = pool.view(-1, page_size * pool.shape[1] * pool.shape[2])
    return by_page.index_select(0, pages).view(-1, pool.shape[1], pool.shape[2])


class TorchNativeBackend(AttentionBackend):
    accepts_stored_kv = True

    def init_forward(self, batch: ForwardBatch) -> None:
        starts = [0]
        for e in batch.extend_lens:
            starts.append(starts[-1] + e)
        lens = zip(batch.prefix_lens, batch.extend_lens)
        in_group = [self._in_decode_group(p, e) for p, e in lens]
        grouped = [i for i, g in enumerate(in_group) if g]
        others = [i for i, g in enumerate(in_group) if not g]
        extends = [self._extend_segment(batch, i, starts[i]) for i in others]
        decode = self._decode_group(batch, grouped, starts) if grouped else None
        batch.attn_metadata = _Metadata(decode=decode, extends=extends)

    supports_tree_mask = True

    def _in_decode_group(self, prefix_len: int, extend_len: int) -> bool:
        """Whether a request's tokens join the batched decode call (else: an extend segment)."""
        return extend_len == 1

    def init_graph_decode(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        # Every row spans the page table's whole capacity (a static shape); the mask trims it.
        # This gathers max_pages * page_size positions per request, which is why the runner
        # does not capture torch_native on CUDA (supports_cuda_graph stays False); the graph
        # tests use it on CPU as the reference.
        token_idx = torch.arange(seq_lens.shape[0], device=seq_lens.device)
        decode = self._masked_decode(batch.page_table, seq_lens, batch.page_table.shape[1],
                                     batch.page_size, token_idx)  # fmt: skip
        batch.attn_metadata = _Metadata(decode=decode, extends=[])

    def _decode_group(
        self, batch: ForwardBatch, reqs: list[int], starts: list[int]
    ) -> _DecodeGroup:
        device = batch.page_table.device
        lens = [batch.seq_lens[i] for i in reqs]
        rows = batch.page_table[torch.tensor(reqs, device=device)]
        token_idx = torch.tensor([starts[i] for i in reqs], device=device)
        seq_lens = torch.tensor(lens, device=device)
        num_pages = -(-max(lens) // batch.page_size)
        return self._masked_decode(rows, seq_lens, num_pages, batch.page_size, token_idx)

    def _masked_decode(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        num_pages: int,
        page_size: int,
        token_idx: torch.Tensor,
    ) -> _DecodeGroup:
        """The first `num_pages` pages of each row, positions masked to its length."""
        positions = torch.arange(num_pages * page_size, device=rows.device)
        valid = positions[None, :] < seq_lens[:, None]
        if self.sliding_window is not None:
            valid &= positions[None, :] > (seq_lens[:, None] - 1) - self.sliding_window
        pages = rows[:, :num_pages].reshape(-1)
        return _DecodeGroup(token_idx, pages, num_pages, mask=valid[:, None, None, :])

    def _extend_segment(self, batch: ForwardBatch, req: int, start: int) -> _ExtendSegment:
        prefix_len, extend_len = batch.prefix_lens[req], batch.extend_lens[req]
        end = start + extend_len
        seq_len = prefix_len + extend_len
        tree = batch.tree_masks.get(req)
        if prefix_len == 0 and self.sliding_window is None and tree is None:
            return _ExtendSegment(start, end, pages=None, seq_len=seq_len, mask=None)
        mask = extend_mask(batch, req, start, self.sliding_window)
        pages = None
        if prefix_len:
            pages = batch.page_table[req, : -(-seq_len // batch.page_size)]
        return _ExtendSegment(start, end, pages=pages, seq_len=seq_len, mask=mask)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer, batch.out_slots, k, v)
        return self.forward_stored(q, k, v, layer, batch)

    def forward_stored(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: _Metadata = batch.attn_metadata
        out = torch.empty_like(q)
        self._forward_extends(q, k, v, layer, meta.extends, batch.page_size, out)
        if meta.decode is not None:
            self._forward_decode(q, layer, meta.decode, batch.page_size, out)
        return out

    def _forward_extends(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        extends: list[_ExtendSegment],
        page_size: int,
        out: torch.Tensor,
    ) -> None:
        """Each extend segment's SDPA, written into its rows of `out`."""
        k_pool, v_pool = self.pool.layer_kv(layer)
        for seg in extends:
            if seg.pages is None:
                ks, vs = k[seg.start : seg.end], v[seg.start : seg.end]
            else:
                ks = _gather_pages(k_pool, seg.pages, page_size)[: seg.seq_len].to(q.dtype)
                vs = _gather_pages(v_pool, seg.pages, page_size)[: seg.seq_len].to(q.dtype)
            out[seg.start : seg.end] = self._sdpa(q[seg.start : seg.end], ks, vs, seg.mask)

    def _forward_decode(
        self, q: torch.Tensor, layer: int, dec: _DecodeGroup, page_size: int, out: torch.Tensor
    ) -> None:
        """All decode tokens in one padded, masked SDPA over their gathered pages."""
        k_pool, v_pool = self.pool.layer_kv(layer)
        num = dec.token_idx.shape[0]
        qd = q[dec.token_idx].unsqueeze(2)  # [num_decode, num_heads, 1, head_dim]
        kd = _gather_pages(k_pool, dec.pages, page_size).to(q.dtype)
        vd = _gather_pages(v_pool, dec.pages, page_size).to(q.dtype)
        # [num_decode, kv_heads, num_pages * page_size, head_dim]
        kd = kd.view(num, -1, *kd.shape[1:]).transpose(1, 2)
        vd = vd.view(num, -1, *vd.shape[1:]).transpose(1, 2)
        o = attend(qd, kd, vd, dec.mask, is_causal=False, logit_cap=self.logit_cap)
        out[dec.token_idx] = o.squeeze(2)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One sequence: q [n, heads, dim], k/v [len, kv_heads, dim] -> [n, heads, dim]."""
        o = attend(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            mask,
            is_causal=mask is None,
            logit_cap=self.logit_cap,
        )
        return o.squeeze(0).transpose(0, 1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    logit_cap: float | None,
) -> torch.Tensor:
    """SDPA of q [b, heads, n, dim] over k, v [b, kv_heads, len, dim] (GQA; mask: True =
    attend). With `logit_cap` (which SDPA lacks) written out as transformers' eager attention:
    scaled scores -> cap * tanh(score / cap), masked, softmax in fp32."""
    if logit_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / logit_cap) * logit_cap
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v
