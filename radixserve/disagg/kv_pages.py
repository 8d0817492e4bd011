"""A KV page as bytes: what prefill/decode disaggregation ships between two pools.

One page holds `page_size` tokens of every layer's K and V:

    pool.k: [layers, num_pages * page_size, kv_heads, head_dim]
    page p: stack(k[:, p*S:(p+1)*S], v[:, p*S:(p+1)*S])  ->  [2, layers, S, kv_heads, head_dim]

Both pools must agree on that shape and dtype (same model, page size and KV dtype); the byte
count, `page_nbytes`, is what the two sides compare before any page moves.
"""

from __future__ import annotations

import torch

from radixserve.cache.kv_pool import KVPool


def page_nbytes(pool: KVPool) -> int:
    """Bytes of one page's K and V across all layers."""
    s = pool.shape
    elements = 2 * s.num_layers * s.page_size * s.num_kv_heads * s.head_dim
    return elements * pool.k.element_size()


def read_page(pool: KVPool, page: int) -> bytes:
    """A copy of page `page`'s K and V, as bytes (off the device)."""
    return pool.read_pages([page]).cpu().view(torch.uint8).numpy().tobytes()


def write_page(pool: KVPool, page: int, data: bytes) -> None:
    """Stores `data` (from `read_page` on a pool of the same shape) into page `page`."""
    if len(data) != page_nbytes(pool):
        raise ValueError(f"a KV page is {page_nbytes(pool)} bytes here; got {len(data)}")
    s = pool.shape
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(pool.dtype)
    pool.write_pages([page], raw.view(1, 2, s.num_layers, s.page_size, s.num_kv_heads, s.head_dim))
