"""RadixCache's match and insert: whole pages only, node splits, the already-cached length,
and namespaces (cache salts) that never share nodes and keep no empty roots."""

from __future__ import annotations

import gc
import weakref

from radix_cache_ops import insert_fresh, make_cache


def test_match_on_empty_tree_finds_nothing():
    allocator, cache = make_cache()
    result = cache.match_prefix([1, 2, 3])
    assert (result.pages, result.num_tokens) == ([], 0)
    cache.lock(result.node)
    cache.unlock(result.node)
    cache.check_integrity()


def test_insert_then_match_page_size_1_leaves_last_token():
    allocator, cache = make_cache(page_size=1)
    pages = insert_fresh(cache, allocator, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 3
    assert cache.match_prefix([1, 2, 3, 4]).pages == pages[:3]
    assert cache.match_prefix([1, 2, 3, 4, 5]).pages == pages
    assert cache.match_prefix([1, 2, 3, 4, 5], max_tokens=2).num_tokens == 2
    assert cache.match_prefix([1, 2, 9], max_tokens=10).num_tokens == 2
    cache.check_integrity()


def test_insert_then_match_page_size_16_in_whole_pages():
    allocator, cache = make_cache(page_size=16)
    tokens = list(range(40))
    pages = insert_fresh(cache, allocator, tokens)
    assert cache.size_info().total_pages == 2  # the partial third page is not cached
    assert cache.match_prefix(tokens).pages == pages[:2]
    assert cache.match_prefix(tokens[:33]).num_tokens == 32
    assert cache.match_prefix(tokens[:32]).num_tokens == 16  # 31 rounds down to one page
    assert cache.match_prefix(tokens, max_tokens=20).num_tokens == 16
    assert cache.match_prefix(tokens[:16] + [99] * 20).pages == pages[:1]
    cache.check_integrity()


def test_partial_match_splits_node_and_both_halves_stay_matchable():
    allocator, cache = make_cache(page_size=2)
    pages = insert_fresh(cache, allocator, [1, 2, 3, 4, 5, 6, 7, 8])
    upper = cache.match_prefix([1, 2, 3, 4, 0, 0, 0])
    assert (upper.num_tokens, upper.pages) == (4, pages[:2])
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert (whole.num_tokens, whole.pages) == (8, pages)
    assert whole.node is not upper.node
    assert cache.size_info().total_pages == 4
    cache.check_integrity()


def test_insert_returns_already_cached_length():
    allocator, cache = make_cache(page_size=2)
    assert cache.insert([1, 2, 3, 4], allocator.allocate(2).tolist()) == 0
    again = allocator.allocate(3).tolist()
    assert cache.insert([1, 2, 3, 4, 5], again) == 4  # the partial third page is not inserted
    allocator.free(again)  # duplicates and the partial page: all still the caller's
    branch = allocator.allocate(2).tolist()
    assert cache.insert([1, 2, 7, 7], branch) == 2
    allocator.free(branch[:1])
    cache.check_integrity()


def test_insert_takes_only_the_new_pages():
    allocator, cache = make_cache(page_size=2)
    first = insert_fresh(cache, allocator, [1, 2, 3, 4])
    second = allocator.allocate(3).tolist()
    assert cache.insert([1, 2, 3, 4, 5, 6], second) == 4
    allocator.free(second[:2])  # duplicates of the tree's pages stay the caller's to free
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0]).pages == first + second[2:]
    cache.check_integrity()


def test_namespaces_never_share_nodes():
    allocator, cache = make_cache(page_size=1)
    insert_fresh(cache, allocator, [1, 2, 3], namespace="a")
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 0
    assert cache.match_prefix([1, 2, 3, 4], namespace="b").num_tokens == 0
    assert cache.match_prefix([1, 2, 3, 4], namespace="a").num_tokens == 3
    pages = allocator.allocate(3).tolist()
    assert cache.insert([1, 2, 3], pages, namespace=None) == 0
    assert cache.match_prefix([1, 2, 3, 4]).pages == pages
    cache.check_integrity()


def test_an_unseen_namespace_gets_its_own_root_and_insert_keeps_it():
    allocator, cache = make_cache(page_size=1)
    salted = cache.match_prefix([1, 2, 3], namespace="s").node
    assert salted is not cache.match_prefix([1, 2, 3]).node
    assert cache.match_prefix([7], namespace="s").node is salted
    assert cache.match_prefix([], namespace="s").node is salted
    assert cache.parent_of(salted) is None
    insert_fresh(cache, allocator, [1, 2, 3], namespace="s")
    deep = cache.match_prefix([1, 2, 3, 4], namespace="s").node
    assert cache.parent_of(deep) is salted  # insert grew the tree under the root match handed out
    cache.check_integrity()


def test_namespace_roots_without_pages_are_not_kept():
    """A salt per user must not pile up roots: an empty one lives only while someone holds it."""
    allocator, cache = make_cache(page_size=1)
    roots = [weakref.ref(cache.match_prefix([1, 2], namespace=f"user{i}").node) for i in range(50)]
    gc.collect()
    assert all(root() is None for root in roots)
    insert_fresh(cache, allocator, [1, 2, 3], namespace="x")
    root = weakref.ref(cache.match_prefix([9], namespace="x").node)
    gc.collect()
    assert root() is not None  # it has pages
    assert cache.evict(10) == 3
    gc.collect()
    assert root() is None  # eviction emptied it
    assert cache.match_prefix([1, 2, 3, 4], namespace="x").num_tokens == 0
    cache.check_integrity()
