"""Paged KV pool: a page allocator and the K/V tensors of all layers.

A token's KV lives in a *slot*: `slot = page * page_size + offset`. A request addresses its
KV through its page table (a list of page ids, one per `page_size` tokens), so no request
needs contiguous memory. Page 0 is reserved as a scratch page: padded entries of a batch
(e.g. CUDA-graph padding) write there and nothing ever reads it.

    k[layer]: [num_pages * page_size, num_kv_heads, head_dim]   (a view of one big tensor)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.config import CacheConfig, ModelConfig
from radixserve.native.machine import check_fits

RESERVED_PAGES = 1  # page 0: scratch


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than were asked for."""


class PageAllocator:
    """Hands out page ids from a free list; detects double frees."""

    def __init__(self, num_pages: int):
        if num_pages <= RESERVED_PAGES:
            raise ValueError(f"num_pages must exceed {RESERVED_PAGES}; got {num_pages}")
        self.num_pages = num_pages
        self._free = torch.arange(RESERVED_PAGES, num_pages, dtype=torch.int64)
        self._num_free = num_pages - RESERVED_PAGES
        self._is_free = torch.ones(num_pages, dtype=torch.bool)
        self._is_free[:RESERVED_PAGES] = False
        # Free-list entries below this index were never handed out (frees push above it).
        self._untouched = self._num_free
        self.on_first_use: Callable[[torch.Tensor], None] | None = None
        """Called with pages handed out for the first time (the pool zeroes their K/V)."""

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the reserved ones)."""
        return self.num_pages - RESERVED_PAGES

    def can_allocate(self, num: int) -> bool:
        return num <= self._num_free

    def allocate(self, num: int) -> torch.Tensor:
        """Returns `num` free page ids as an int64 tensor; raises OutOfPagesError if short."""
        if num < 0:
            raise ValueError(f"num must be >= 0; got {num}")
        if num > self._num_free:
            raise OutOfPagesError(
                f"asked for {num} KV pages but only {self._num_free} of {self.capacity} are free"
            )
        start = self._num_free - num
        pages = self._free[start : self._num_free].clone()
        if start < self._untouched:
            if self.on_first_use is not None:
                self.on_first_use(self._free[start : self._untouched])
            self._untouched = start
        self._num_free = start
        self._is_free[pages] = False
        return pages

    def free(self, pages: torch.Tensor | list[int]) -> None:
        """Returns pages to the free list; raises ValueError on a double or foreign free."""
        pages = torch.as_tensor(pages, dtype=torch.int64).flatten()
        if pages.numel() == 0:
            return
        if int(pages.min()) < RESERVED_PAGES or int(pages.max()) >= self.num_pages:
            raise ValueError(f"page ids out of range [{RESERVED_PAGES}, {self.num_pages})")
        if bool(self._is_free[pages].any()) or pages.unique().numel() != pages.numel():
            raise ValueError("double free: some pages are already free")
        self._is_free[pages] = True
        end = self._num_free + pages.numel()
        self._free[self._num_free : end] = pages
        self._num_free = end

    def free_pages(self) -> torch.Tensor:
        """The ids of all free pages (a copy), for integrity checks."""
        return self._free[: self._num_free].clone()


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def pool_shape(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    bytes_per_token: float,
    budget_bytes: int | None = None,
) -> PoolShape:
    """The pool's shape: `max_total_tokens`, else `budget_bytes` // `bytes_per_token` tokens."""
    page_size = cache_config.page_size  # >= 1: CacheConfig checks it
    if cache_config.max_total_tokens is not None:
        num_tokens = cache_config.max_total_tokens
    elif budget_bytes is not None:
        num_tokens = int(budget_bytes // bytes_per_token)
    else:
        raise ValueError("give max_total_tokens or a memory budget to size the KV pool")
    num_pages = num_tokens // page_size + RESERVED_PAGES
    if num_pages <= RESERVED_PAGES:
        raise ValueError(
            f"KV pool of {num_tokens} tokens holds no page of {page_size} tokens "
            "(--page-size); raise --max-total-tokens or the memory budget"
        )
    return PoolShape(
        num_layers=model_config.num_layers,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
    )


class KVPool:
    """K/V tensors for every layer, in pages of `page_size` tokens, plus their allocator."""

    sliding_window: int | None = None
    """Set by a HybridKVPool (cache/swa_pool.py): its sliding layers keep only what this
    window still reads; None: every page keeps every layer's K/V."""

    def __init__(self, shape: PoolShape, dtype: torch.dtype, device: torch.device | str):
        self.shape = shape
        self.page_size = shape.page_size
        self.dtype = dtype
        self.device = torch.device(device)
        dims = (
            shape.num_layers,
            shape.num_pages * shape.page_size,
            shape.num_kv_heads,
            shape.head_dim,
        )
        check_fits(
            2 * math.prod(dims) * dtype.itemsize,
            self.device,
            f"a KV pool of {shape.num_pages * shape.page_size} tokens",
            "lower --max-total-tokens (or --cpu-kv-cache-gb, --mem-fraction-static)",
        )
        # Uninitialized (no multi-GB memset up front): a page is zeroed when first handed out,
        # and the scratch page now, so that attention reading whole pages (masked positions
        # included) never meets a NaN.
        self.k = torch.empty(dims, dtype=dtype, device=self.device)
        self.v = torch.empty(dims, dtype=dtype, device=self.device)
        # each layer's (K, V) views, made once: an eager forward asks for them twice a layer
        self._layer_views = list(zip(self.k.unbind(0), self.v.unbind(0)))
        self.allocator = PageAllocator(shape.num_pages)
        self.allocator.on_first_use = self.zero_pages
        self.zero_pages(torch.arange(RESERVED_PAGES))

    @classmethod
    def for_model(
        cls,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        budget_bytes: int | None = None,
    ) -> KVPool:
        """Sizes a pool from `max_total_tokens`, else from `budget_bytes` (a memory budget)."""
        per_token = model_config.kv_bytes_per_token(dtype)
        return cls(pool_shape(model_config, cache_config, per_token, budget_bytes), dtype, device)

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.capacity * self.page_size

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def extend_page_table(self, page_table: list[int], new_len: int) -> list[int]:
        """Allocates the pages a sequence needs to reach `new_len` tokens; returns the new table."""
        missing = self.num_pages_for(new_len) - len(page_table)
        if missing <= 0:
            return page_table
        return page_table + self.allocator.allocate(missing).tolist()

    def zero_pages(self, pages: torch.Tensor) -> None:
        """Zeroes the K/V of `pages` (a page id tensor) in every layer."""
        pages = pages.to(self.device)
        if self.k.numel() == 0:  # a pool of no layers (every layer slides: swa_pool.py)
            return
        for buf in (self.k, self.v):
            buf.view(buf.shape[0], -1, self.page_size * buf.shape[2] * buf.shape[3]).index_fill_(
                1, pages, 0
            )

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [num_slots, num_kv_heads, head_dim]."""
        if torch.compiler.is_compiling():  # traced: index the pool, no stored views as inputs
            return self.k[layer], self.v[layer]
        return self._layer_views[layer]

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of the K/V of `pages`, all layers: [num, 2, layers, page_size, kv_heads,
        head_dim] (one page's bytes are what a tier slot or a KV transfer holds)."""
        index = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        s = self.shape
        dims = (len(pages), 2, s.num_layers, s.page_size, s.num_kv_heads, s.head_dim)
        out = torch.empty(dims, dtype=self.dtype, device=self.device)
        for i, buf in enumerate((self.k, self.v)):  # gather, then one strided copy: 2 passes
            out[:, i].copy_(self._paged(buf)[:, index].transpose(0, 1))
        return out

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        """Stores `kv` (as `read_pages` returns it, any device) into `pages`."""
        index = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        kv = kv.to(self.device, self.dtype).permute(1, 2, 0, 3, 4, 5)
        self._paged(self.k).index_copy_(1, index, kv[0])
        self._paged(self.v).index_copy_(1, index, kv[1])

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copies the K/V of slots `src` to slots `dst`, every layer (all read before any
        is written, so the two may overlap)."""
        src_t = torch.as_tensor(src, dtype=torch.int64, device=self.device)
        dst_t = torch.as_tensor(dst, dtype=torch.int64, device=self.device)
        for buf in (self.k, self.v):
            buf.index_copy_(1, dst_t, buf.index_select(1, src_t))

    def _paged(self, buf: torch.Tensor) -> torch.Tensor:
        """`buf` viewed by page: [layers, num_pages, page_size, kv_heads, head_dim]."""
        s = self.shape
        return buf.view(s.num_layers, s.num_pages, s.page_size, s.num_kv_heads, s.head_dim)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores new K/V ([num_tokens, num_kv_heads, head_dim]) into their slots."""
        if torch.compiler.is_compiling():  # traced by torch.compile: see write_slots
            torch.ops.radixserve.kv_write_slots(
                self.k[layer], self.v[layer], slots, k.to(self.dtype), v.to(self.dtype)
            )
            return
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))


def write_slots(
    k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """`KVPool.write` as an opaque op that mutates the pool in place. Traced by torch.compile,
    a plain `index_copy_` into the pool is functionalized into a copy of the whole layer's
    K/V (29 ms a step on a 65k-slot pool of a 2-layer model); an op whose schema declares
    what it mutates is kept in place. Defined with torch.library.Library rather than
    `custom_op`, whose Python wrapper cost ~60 us a call (14 us this way); eager writes
    skip the op altogether."""
    k_buf.index_copy_(0, slots, k)
    v_buf.index_copy_(0, slots, v)


def _write_slots_fake(k_buf, v_buf, slots, k, v) -> None:
    return None


_OPS = torch.library.Library("radixserve", "FRAGMENT")
_OPS.define(
    "kv_write_slots(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor slots, Tensor k, Tensor v) -> ()"
)
_OPS.impl("kv_write_slots", write_slots, "CompositeExplicitAutograd")
torch.library.register_fake("radixserve::kv_write_slots", _write_slots_fake, lib=_OPS)
