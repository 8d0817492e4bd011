"""What the RadixCache tests (tests/test_radix_cache_*.py, the KV event tests) share: a cache
over its own page allocator, and inserting tokens with fresh pages as a finished request
would."""

from __future__ import annotations

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.radix_cache import RadixCache


def make_cache(page_size: int = 1, num_pages: int = 65) -> tuple[PageAllocator, RadixCache]:
    allocator = PageAllocator(num_pages)
    return allocator, RadixCache(allocator, page_size)


def insert_fresh(cache, allocator, tokens, namespace=None) -> list[int]:
    """Inserts `tokens` with newly allocated pages, freeing what the cache does not take."""
    size = cache.page_size
    pages = allocator.allocate(-(-len(tokens) // size)).tolist()
    num_cached = cache.insert(tokens, pages, namespace)
    allocator.free(pages[: num_cached // size] + pages[len(tokens) // size :])
    return pages
