"""Retention pins in the radix cache and the PinTable: protection, TTLs, the bound."""

from __future__ import annotations

import pytest

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.retention import PinTable, prefix_pin_key, session_pin_key


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_table(num_pages: int = 21, max_pinned: int = 6, page_size: int = 1):
    allocator = PageAllocator(num_pages)
    cache = RadixCache(allocator, page_size)
    clock = FakeClock()
    return allocator, cache, PinTable(cache, max_pinned, clock), clock


def insert(cache, allocator, tokens, priority=0) -> None:
    pages = allocator.allocate(len(tokens) // cache.page_size).tolist()
    num_cached = cache.insert(tokens, pages, priority=priority)
    allocator.free(pages[: num_cached // cache.page_size])


def test_pinned_prefix_survives_eviction_and_counts_as_pinned():
    allocator, cache, table, _ = make_table()
    insert(cache, allocator, [1, 2, 3, 4])
    insert(cache, allocator, [5, 6, 7])
    assert table.pin(session_pin_key("a"), [1, 2, 3, 4]).num_tokens == 4
    info = cache.size_info()
    assert (info.pinned_pages, info.evictable_pages, info.total_pages) == (4, 3, 7)
    assert cache.evict(100) == 3
    assert cache.match_prefix([1, 2, 3, 4], max_tokens=4).num_tokens == 4
    cache.check_integrity()
    assert table.unpin(session_pin_key("a"))
    assert cache.evict(100) == 4
    cache.check_integrity()


def test_pin_of_uncached_tokens_pins_nothing():
    allocator, cache, table, _ = make_table()
    assert table.pin(prefix_pin_key("tools"), [9, 9]) is None
    assert len(table) == 0


def test_pin_survives_a_split_and_a_locked_overlap():
    allocator, cache, table, _ = make_table()
    insert(cache, allocator, [1, 2, 3, 4])
    table.pin("session:a", [1, 2, 3, 4])
    match = cache.match_prefix([1, 2, 9], max_tokens=3)  # splits (1 2 | 3 4)
    cache.lock(match.node)
    cache.check_integrity()
    assert cache.evict(100) == 0
    cache.unlock(match.node)
    table.clear()
    assert cache.evict(100) == 4
    cache.check_integrity()


def test_ttl_expiry_and_renewal():
    allocator, cache, table, clock = make_table()
    insert(cache, allocator, [1, 2, 3])
    table.pin("session:a", [1, 2, 3], ttl_s=10)
    clock.now = 9
    table.pin("session:a", [1, 2, 3], ttl_s=10)  # the next turn renews it
    clock.now = 15
    assert table.expire() == 0
    clock.now = 19
    assert table.expire() == 1
    assert cache.num_pinned_pages() == 0 and cache.evict(100) == 3


def test_bound_lets_the_oldest_pins_degrade_to_lru():
    allocator, cache, table, clock = make_table(max_pinned=6)
    for i in range(4):
        insert(cache, allocator, [10 * i + 1, 10 * i + 2, 10 * i + 3])
        clock.now = i
        table.pin(f"session:{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3])
        assert cache.num_pinned_pages() <= 6
    assert [p["name"] for p in table.describe()] == ["2", "3"]
    assert table.num_degraded == 2
    assert cache.evict(100) == 6  # the degraded sessions are plain LRU again
    cache.check_integrity()


def test_shared_pages_count_once_against_the_bound():
    allocator, cache, table, _ = make_table(max_pinned=5)
    insert(cache, allocator, [1, 2, 3, 4])
    insert(cache, allocator, [1, 2, 3, 5])
    table.pin("session:a", [1, 2, 3, 4])
    table.pin("session:b", [1, 2, 3, 5])
    assert cache.num_pinned_pages() == 5 and len(table) == 2


def test_a_pin_larger_than_the_bound_is_let_go_at_once():
    allocator, cache, table, _ = make_table(max_pinned=2)
    insert(cache, allocator, [1, 2, 3])
    assert table.pin("prefix:big", [1, 2, 3]) is None
    assert cache.num_pinned_pages() == 0


def test_release_oldest_under_pressure():
    allocator, cache, table, clock = make_table()
    insert(cache, allocator, [1, 2])
    insert(cache, allocator, [3, 4])
    table.pin("session:old", [1, 2])
    clock.now = 1
    table.pin("session:new", [3, 4])
    assert table.release_oldest()
    assert "session:old" not in table and "session:new" in table
    assert cache.evict(100) == 2


def test_reset_refuses_while_pinned():
    allocator, cache, table, _ = make_table()
    insert(cache, allocator, [1, 2])
    table.pin("prefix:x", [1, 2])
    with pytest.raises(RuntimeError, match="pinned"):
        cache.reset()
    table.clear()
    cache.reset()
    assert allocator.num_free == allocator.capacity


def test_eviction_takes_lower_priority_first():
    allocator, cache, _, _ = make_table()
    insert(cache, allocator, [1, 2], priority=5)
    insert(cache, allocator, [3, 4])  # more recent, but priority 0
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 2], max_tokens=2).num_tokens == 2
    assert cache.match_prefix([3, 4], max_tokens=2).num_tokens == 0


def test_tree_summary_reports_subtrees_hits_and_pins():
    allocator, cache, table, _ = make_table()
    insert(cache, allocator, [1, 2, 3, 4])
    insert(cache, allocator, [1, 2, 7])
    insert(cache, allocator, [8, 9])
    match = cache.match_prefix([1, 2, 3, 4], max_tokens=4)
    cache.record_hit(match.node)  # one admitted request whose cached prefix ends there
    table.pin("session:a", [8, 9])
    summary = cache.tree_summary(top_k=1)
    assert (summary.num_nodes, summary.max_depth, summary.num_tokens) == (4, 2, 7)
    top = summary.largest_subtrees[0]
    assert (top.first_token_ids, top.num_tokens, top.num_nodes, top.hit_count) == (
        [1, 2],
        5,
        3,
        1,
    )
    assert not top.pinned
    assert cache.tree_summary().largest_subtrees[1].pinned


def test_a_pin_name_is_its_namespaces_so_tenants_cannot_touch_each_others():
    allocator, cache, table, _ = make_table(max_pinned=20)
    pages_a = allocator.allocate(4).tolist()
    cache.insert([1, 2, 3, 4], pages_a, namespace="salt-a")
    pages_b = allocator.allocate(4).tolist()
    cache.insert([1, 2, 3, 4], pages_b, namespace="salt-b")
    key = prefix_pin_key("tools")
    assert table.pin(key, [1, 2, 3, 4], namespace="salt-a") is not None
    assert table.pin(key, [1, 2, 3, 4], namespace="salt-b") is not None  # no replacement
    assert len(table) == 2 and cache.size_info().pinned_pages == 8
    assert not table.unpin(key)  # the default namespace has no such pin
    assert table.unpin(key, "salt-b") and not table.unpin(key, "salt-b")
    assert [(p["name"], p["namespace"]) for p in table.describe()] == [("tools", "salt-a")]
    assert cache.evict(100) == 4  # B's pages are plain LRU again; A's stay pinned
    assert cache.match_prefix([1, 2, 3, 4], "salt-a", max_tokens=4).num_tokens == 4
    cache.check_integrity()
