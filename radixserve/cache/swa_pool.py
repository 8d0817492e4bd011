"""Two page spaces for sliding-window models: global layers by page id, sliding layers by a
sliding page that a page keeps only while some window still reads it (after SGLang's
SWAKVPool).

    page id p (HybridPageAllocator)   global layers' K/V: HybridKVPool.k[:, p * page_size ...]
      └─ sliding_page[p] = s          sliding layers' K/V: HybridKVPool.sliding.k[:, s * ...]
         (0: tombstoned -> the scratch page, never read: masks keep the window off it)

Allocating a page allocates its sliding page too; freeing a page frees both; `free_sliding`
tombstones a page (its global K/V stays). Attention translates a batch's page table and
out slots through `sliding_page` for the sliding layers (attention/layer_windows.py).

Under tensor parallelism the table is rank 0's (its scheduler allocates): `track_changes`
records the entries it rewrites, and each batch carries them to the other ranks, whose
tables `apply_changes` keeps equal (model/tp_batch.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from radixserve.cache.kv_pool import (
    RESERVED_PAGES,
    KVPool,
    OutOfPagesError,
    PageAllocator,
    PoolShape,
    pool_shape,
)
from radixserve.config import CacheConfig, ModelConfig

logger = logging.getLogger(__name__)
_NO_PAGES = torch.empty(0, dtype=torch.int64)


class HybridPageAllocator(PageAllocator):
    """Page ids as PageAllocator hands them out, each with a page of the sliding space."""

    def __init__(self, num_pages: int, num_sliding_pages: int, device: torch.device):
        super().__init__(num_pages)
        self.sliding = PageAllocator(num_sliding_pages)
        self.sliding_page = torch.zeros(num_pages, dtype=torch.int64)  # page -> sliding page
        on_host = torch.device(device).type == "cpu"
        self.device_table = self.sliding_page if on_host else self.sliding_page.to(device)
        self._changed: list[torch.Tensor] | None = None  # pages remapped since take_changes

    def track_changes(self) -> None:
        """From now on, remember which pages' sliding pages change (for `take_changes`)."""
        self._changed = []

    def take_changes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, their sliding pages now) for every page remapped since the last call."""
        if not self._changed:
            return _NO_PAGES, _NO_PAGES
        pages = torch.cat(self._changed).unique()
        self._changed.clear()
        return pages, self.sliding_page[pages]

    def apply_changes(self, pages: torch.Tensor, sliding: torch.Tensor) -> None:
        """Sets `pages`' sliding pages as another rank's `take_changes` reported them."""
        self._map(pages.cpu(), sliding.cpu())

    @property
    def num_free(self) -> int:
        """Pages that can be handed out with their sliding pages."""
        return min(self._num_free, self.sliding.num_free)

    @property
    def num_free_global(self) -> int:
        """Free page ids, whatever the sliding space has."""
        return self._num_free

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out with their sliding pages."""
        return min(super().capacity, self.sliding.capacity)

    @property
    def capacity_global(self) -> int:
        return super().capacity

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_free

    def allocate(self, num: int) -> torch.Tensor:
        if num > self.sliding.num_free:
            raise OutOfPagesError(
                f"asked for {num} KV pages but only {self.sliding.num_free} of "
                f"{self.sliding.capacity} sliding-window pages are free"
            )
        pages = super().allocate(num)
        self._map(pages, self.sliding.allocate(num))
        return pages

    def free(self, pages: torch.Tensor | list[int]) -> None:
        pages = torch.as_tensor(pages, dtype=torch.int64).flatten()
        super().free(pages)
        self.free_sliding(pages)

    def free_sliding(self, pages: torch.Tensor | Sequence[int]) -> int:
        """Tombstones `pages`: frees their live sliding pages; returns how many."""
        pages = torch.as_tensor(pages, dtype=torch.int64).flatten()
        live = self.sliding_page[pages]
        live = live[live != 0]
        if live.numel():
            self.sliding.free(live)
            self._map(pages, torch.zeros_like(pages))
        return int(live.numel())

    def move_sliding(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Gives the sliding pages of pages `src` to the tombstoned pages `dst`."""
        self._map(dst, self.sliding_page[src])
        self._map(src, torch.zeros_like(src))

    def is_free_mask(self) -> torch.Tensor:
        """[num_pages] bool: which page ids are free (a copy), for integrity checks."""
        return self._is_free.clone()

    def is_live(self, pages: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Whether each of `pages` has its sliding page (bool tensor)."""
        return self.sliding_page[torch.as_tensor(pages, dtype=torch.int64)] != 0

    def _map(self, pages: torch.Tensor, sliding: torch.Tensor) -> None:
        self.sliding_page[pages] = sliding
        if self._changed is not None:
            self._changed.append(pages.clone())
        if self.device_table is not self.sliding_page:
            device = self.device_table.device
            self.device_table[pages.to(device)] = sliding.to(device)


class LayerSubsetPool(KVPool):
    """A KVPool holding the K/V of some decoder layers only (`layers`, in model order)."""

    def __init__(
        self,
        shape: PoolShape,
        dtype: torch.dtype,
        device: torch.device | str,
        layers: Sequence[int],
    ):
        super().__init__(shape, dtype, device)
        self.layers = tuple(layers)
        self._index = {layer: i for i, layer in enumerate(self.layers)}

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index[layer]
        return (self.k[i], self.v[i]) if torch.compiler.is_compiling() else self._layer_views[i]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buf, v_buf = self.layer_kv(layer)
        if torch.compiler.is_compiling():  # traced by torch.compile: see kv_pool.write_slots
            torch.ops.radixserve.kv_write_slots(
                k_buf, v_buf, slots, k.to(self.dtype), v.to(self.dtype)
            )
            return
        k_buf.index_copy_(0, slots, k.to(self.dtype))
        v_buf.index_copy_(0, slots, v.to(self.dtype))


class HybridKVPool(LayerSubsetPool):
    """The global layers' K/V by page id and, in `sliding`, the sliding layers' K/V by
    sliding page; `allocator` hands out both (HybridPageAllocator)."""

    def __init__(
        self,
        shape: PoolShape,
        num_sliding_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layer_windows: Sequence[int | None],
    ):
        global_layers = [i for i, w in enumerate(layer_windows) if w is None]
        sliding_layers = [i for i, w in enumerate(layer_windows) if w is not None]
        super().__init__(_with(shape, len(global_layers), shape.num_pages), dtype, device,
                         global_layers)  # fmt: skip
        sliding_shape = _with(shape, len(sliding_layers), num_sliding_pages)
        self.sliding = LayerSubsetPool(sliding_shape, dtype, device, sliding_layers)
        self.sliding_window = max(w for w in layer_windows if w is not None)
        self.allocator = HybridPageAllocator(shape.num_pages, num_sliding_pages, self.device)
        self.allocator.on_first_use = self.zero_pages
        self.allocator.sliding.on_first_use = self.sliding.zero_pages
        self.sliding.allocator = self.allocator.sliding

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the pool holds (its sliding pages tombstoned but the last)."""
        return self.allocator.capacity_global * self.page_size

    def translate_pages(self, page_table: torch.Tensor) -> torch.Tensor:
        """A page table (any shape) in sliding pages (0 where tombstoned)."""
        return self.allocator.device_table[page_table]

    def translate_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Pool slots as slots of the sliding space."""
        size = self.page_size
        return self.allocator.device_table[slots // size] * size + slots % size

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        super().copy_slots(src, dst)
        to_sliding = self.translate_slots
        device = self.device
        src_t = to_sliding(torch.as_tensor(src, dtype=torch.int64, device=device)).tolist()
        self.sliding.copy_slots(src_t, to_sliding(torch.as_tensor(dst, device=device)).tolist())

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        raise NotImplementedError(_NO_PAGE_COPIES)

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        raise NotImplementedError(_NO_PAGE_COPIES)

    def memory_bytes(self) -> tuple[int, int]:
        """Bytes of (global layers', sliding layers') K/V."""
        return (
            2 * self.k.numel() * self.k.element_size(),
            2 * self.sliding.k.numel() * self.sliding.k.element_size(),
        )


_NO_PAGE_COPIES = (
    "a page's K/V lives in two page spaces with a sliding-window model; copying whole pages "
    "(hierarchical cache, disaggregation) needs --disable-hybrid-swa-memory"
)


def _with(shape: PoolShape, num_layers: int, num_pages: int) -> PoolShape:
    return PoolShape(num_layers, num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)


def uses_sliding_space(model_config: ModelConfig, cache_config: CacheConfig) -> bool:
    """Whether the model's sliding layers get their own page space."""
    return bool(model_config.sliding_layers) and not cache_config.disable_hybrid_swa_memory


def create_kv_pool(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    budget_bytes: int | None = None,
) -> KVPool:
    """KVPool.for_model, or for a sliding-window model a HybridKVPool whose sliding space
    holds --swa-full-tokens-ratio of the global space's tokens (the budget shared so)."""
    if not uses_sliding_space(model_config, cache_config):
        return KVPool.for_model(model_config, cache_config, dtype, device, budget_bytes)
    ratio = cache_config.swa_full_tokens_ratio
    page_size = cache_config.page_size
    windows = model_config.layer_windows()
    num_sliding = len(model_config.sliding_layers)
    per_layer = model_config.kv_bytes_per_token(dtype) / model_config.num_layers
    per_token = per_layer * ((len(windows) - num_sliding) + ratio * num_sliding)
    shape = pool_shape(model_config, cache_config, per_token, budget_bytes)
    num_sliding_pages = int((shape.num_pages - RESERVED_PAGES) * ratio) + RESERVED_PAGES
    # a window, a page of slack and one page of prefill chunk (ReqPages.max_chunk_tokens)
    min_pages = -(-model_config.sliding_window // page_size) + 3 + RESERVED_PAGES
    if num_sliding_pages < min_pages:
        raise ValueError(
            f"--swa-full-tokens-ratio {ratio} leaves {num_sliding_pages - RESERVED_PAGES} "
            f"sliding-window pages, fewer than one window of {model_config.sliding_window} "
            f"tokens needs ({min_pages - RESERVED_PAGES}); raise it or the pool's size"
        )
    hybrid = HybridKVPool(shape, num_sliding_pages, dtype, device, windows)
    full, sliding = hybrid.memory_bytes()
    logger.info(
        "KV pool: %d pages for the global layers (%.1f MiB), %d for the sliding layers "
        "(%.1f MiB)", shape.num_pages, full / 2**20, num_sliding_pages, sliding / 2**20,
    )  # fmt: skip
    return hybrid
