"""RadixCache's locks and eviction: a lock protects a prefix (also across node splits),
eviction takes least recently used leaves first and cascades, reset frees everything, and
the size info counts evictable and protected pages."""

from __future__ import annotations

import pytest
from radix_cache_ops import insert_fresh, make_cache

from radixserve.cache.prefix_cache import CacheSizeInfo


def test_lock_protects_from_evict():
    allocator, cache = make_cache(page_size=1)
    kept = insert_fresh(cache, allocator, [1, 2, 3])
    insert_fresh(cache, allocator, [5, 6])
    match = cache.match_prefix([1, 2, 3, 4])
    cache.lock(match.node)
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3, 4]).pages == kept
    cache.unlock(match.node)
    assert cache.evict(100) == 3
    cache.check_integrity()


def test_splitting_a_locked_node_keeps_both_halves_locked():
    allocator, cache = make_cache(page_size=2)
    insert_fresh(cache, allocator, [1, 2, 3, 4, 5, 6])
    long = cache.match_prefix([1, 2, 3, 4, 5, 6, 0])
    cache.lock(long.node)
    assert cache.match_prefix([1, 2, 3, 4, 0]).num_tokens == 4  # splits the locked node
    insert_fresh(cache, allocator, [1, 2, 9, 9])  # splits it again, adds an unlocked leaf
    assert cache.size_info() == CacheSizeInfo(1, 3, 4)
    assert cache.evict(10) == 1
    cache.check_integrity()
    cache.unlock(long.node)
    assert cache.size_info() == CacheSizeInfo(3, 0, 3)
    cache.check_integrity()


def test_unlock_below_zero_raises():
    allocator, cache = make_cache()
    insert_fresh(cache, allocator, [1, 2])
    node = cache.match_prefix([1, 2, 3]).node
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(node)


def test_evict_takes_least_recently_used_leaf_first():
    allocator, cache = make_cache(page_size=1)
    insert_fresh(cache, allocator, [1, 1])
    insert_fresh(cache, allocator, [2, 2])
    cache.match_prefix([1, 1, 0])  # touch: [2, 2] is now the older leaf
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2, 0]).num_tokens == 0
    assert cache.match_prefix([1, 1, 0]).num_tokens == 2


def test_evict_cascades_to_parents_that_become_leaves():
    allocator, cache = make_cache(page_size=2)
    insert_fresh(cache, allocator, [1, 2, 3, 4])
    insert_fresh(cache, allocator, [1, 2, 5, 6])
    assert cache.size_info().total_pages == 3
    assert cache.evict(3) == 3
    assert cache.size_info().total_pages == 0
    assert allocator.num_free == allocator.capacity
    cache.check_integrity()


def test_evict_more_than_available_frees_what_it_can():
    allocator, cache = make_cache(page_size=1)
    insert_fresh(cache, allocator, [1, 2, 3])
    whole = cache.match_prefix([1, 2, 3, 4])  # not locked: its handle goes stale on evict
    match = cache.match_prefix([1, 2, 3])
    cache.lock(match.node)  # protects [1, 2]; splits off [3]
    assert cache.evict(50) == 1
    assert cache.size_info().total_pages == 2
    with pytest.raises(RuntimeError, match="evicted"):
        cache.lock(whole.node)
    cache.unlock(match.node)
    cache.check_integrity()


def test_reset_frees_everything_and_refuses_when_locked():
    allocator, cache = make_cache(page_size=2)
    insert_fresh(cache, allocator, [1, 2, 3, 4])
    insert_fresh(cache, allocator, [1, 2, 3, 4], namespace="x")
    match = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(match.node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(match.node)
    cache.reset()
    assert allocator.num_free == allocator.capacity
    assert cache.match_prefix([1, 2, 3, 4, 5]).num_tokens == 0
    cache.check_integrity()


def test_size_info_counts_evictable_and_protected_pages():
    allocator, cache = make_cache(page_size=2)
    insert_fresh(cache, allocator, [1, 2, 3, 4, 5, 6])
    insert_fresh(cache, allocator, [7, 8])
    cache.lock(cache.match_prefix([1, 2, 3, 4, 0]).node)
    info = cache.size_info()
    assert (info.evictable_pages, info.protected_pages, info.total_pages) == (2, 2, 4)
    assert cache.num_evictable_pages() == 2
