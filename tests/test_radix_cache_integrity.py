"""NoPrefixCache, the prefix cache factory, and the integrity check that finds a leaked or
double-owned page."""

from __future__ import annotations

import pytest
from radix_cache_ops import insert_fresh, make_cache

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import CacheIntegrityError, NoPrefixCache
from radixserve.cache.radix_cache import RadixCache, create_prefix_cache


def test_no_prefix_cache_frees_inserted_pages_at_once():
    allocator = PageAllocator(17)
    cache = create_prefix_cache(True, allocator, page_size=4)
    assert isinstance(cache, NoPrefixCache)
    pages = allocator.allocate(3).tolist()
    assert cache.insert(list(range(10)), pages) == 0
    assert allocator.num_free == 16 - 1  # the partial third page stays the caller's
    result = cache.match_prefix(list(range(10)))
    assert (result.pages, result.num_tokens) == ([], 0)
    cache.lock(result.node)
    assert cache.evict(5) == 0 and cache.size_info().total_pages == 0
    cache.check_integrity(held_pages=pages[2:])
    with pytest.raises(CacheIntegrityError, match="leaked"):
        cache.check_integrity()


def test_factory_builds_a_radix_cache_by_default():
    assert isinstance(create_prefix_cache(False, PageAllocator(5), 1), RadixCache)


def test_check_integrity_detects_leaked_page():
    allocator, cache = make_cache(page_size=1, num_pages=9)
    insert_fresh(cache, allocator, [1, 2])
    lost = allocator.allocate(1).tolist()
    with pytest.raises(CacheIntegrityError, match=rf"leaked pages .*\[{lost[0]}\]"):
        cache.check_integrity()
    cache.check_integrity(held_pages=lost)


def test_check_integrity_detects_double_owned_page():
    allocator, cache = make_cache(page_size=1, num_pages=9)
    pages = insert_fresh(cache, allocator, [1, 2])
    with pytest.raises(CacheIntegrityError, match=rf"page {pages[0]} has several owners"):
        cache.check_integrity(held_pages=[pages[0]])
    free_page = allocator.free_pages().tolist()[0]
    with pytest.raises(CacheIntegrityError, match="free x1, held x1"):
        cache.check_integrity(held_pages=[free_page])
