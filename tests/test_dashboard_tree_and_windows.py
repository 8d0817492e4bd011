"""What the live dashboard summarises, without a server: the radix tree's outline (sizes,
hits, labels, bounded), the sliding windows of latencies and counters, and how often the
tree is refetched."""

from __future__ import annotations

import pytest

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import NoPrefixCache
from radixserve.cache.radix_cache import RadixCache
from radixserve.server.dashboard_stats import TREE_REFRESH_S, DashboardStats
from radixserve.server.sliding_window import CounterWindow, LatencyWindow


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- the tree summary ----------------------------------------------------------------


def make_cache(num_pages: int = 64, page_size: int = 2) -> RadixCache:
    return RadixCache(PageAllocator(num_pages), page_size)


def insert(cache: RadixCache, tokens: list[int]) -> None:
    pages = cache.allocator.allocate(len(tokens) // cache.page_size).tolist()
    present = cache.insert(tokens, pages)
    cache.allocator.free(pages[: present // cache.page_size])


def test_tree_summary_sizes_hits_and_labels():
    cache = make_cache()
    shared = [1, 2, 3, 4, 5, 6]
    insert(cache, shared + [7, 8])
    insert(cache, shared + [9, 10, 11, 12])
    insert(cache, [20, 21])
    for _ in range(3):
        cache.record_hit(cache.match_prefix(shared + [9, 10, 99]).node)
    tree = cache.tree_outline()
    assert tree["subtree_tokens"] == 6 + 2 + 4 + 2
    big, small = tree["children"]
    assert (big["tokens"], big["subtree_tokens"], big["first_ids"]) == (6, 12, shared)
    assert big["hits"] == 3  # split by the match: the upper half keeps every hit
    assert [c["subtree_tokens"] for c in big["children"]] == [4, 2]  # largest first
    assert [c["hits"] for c in big["children"]] == [3, 0]
    assert (small["tokens"], small["first_ids"], small["hits"]) == (2, [20, 21], 0)
    cache.check_integrity()


def test_tree_summary_bounds_nodes_and_counts_what_it_hides():
    cache = make_cache(num_pages=64)
    for i in range(10):
        insert(cache, [1, 1, 100 + i, 0] + [0] * 2 * i)  # 10 branches under one node
    tree = cache.tree_outline(max_nodes=4, max_children=3)
    (root_child,) = tree["children"]
    assert len(root_child["children"]) == 3 and root_child["num_hidden"] == 7
    shown = sum(c["subtree_tokens"] for c in root_child["children"])
    assert shown + root_child["hidden_tokens"] == root_child["subtree_tokens"] - 2
    assert cache.tree_outline(max_nodes=1)["children"][0]["num_hidden"] == 10
    with pytest.raises(ValueError, match="max_nodes"):
        cache.tree_outline(max_nodes=0)


def test_tree_summary_of_no_cache_is_empty():
    tree = NoPrefixCache(PageAllocator(8), 2).tree_outline()
    assert tree["children"] == [] and tree["subtree_tokens"] == 0


# ---- sliding windows -----------------------------------------------------------------


def test_latency_window_percentiles_forget_old_samples():
    clock = FakeClock()
    window = LatencyWindow(window_s=60, max_samples=1000, clock=clock)
    assert window.percentiles().as_dict() == {"count": 0, "p50": None, "p99": None}
    for v in range(1, 101):
        window.observe(float(v))
    p = window.percentiles()
    assert (p.count, p.p50, p.p99) == (100, 50.0, 99.0)
    clock.now += 61
    window.observe(7.0)
    assert window.percentiles().as_dict() == {"count": 1, "p50": 7.0, "p99": 7.0}
    bounded = LatencyWindow(max_samples=10, clock=clock)
    for v in range(50):
        bounded.observe(float(v))
    assert bounded.percentiles().count == 10


def test_counter_window_growth_over_the_last_minute():
    clock = FakeClock()
    window = CounterWindow(window_s=60, min_gap_s=1, clock=clock)
    window.record({"n": 0})
    assert window.growth() is None
    for n in range(1, 200):
        clock.now += 1
        window.record({"n": n})
    seconds, growth = window.growth()
    assert seconds == 60 and growth == {"n": 60}
    clock.now += 0.5  # closer than min_gap_s: replaces the newest snapshot
    window.record({"n": 300})
    assert window.growth()[1] == {"n": 300 - 139} and len(window._snapshots) <= 62


def test_tree_is_refetched_only_after_the_refresh_period():
    clock = FakeClock()
    board = DashboardStats(clock=clock)
    assert board.tree_is_stale()
    board.set_tree({"children": []})
    clock.now += TREE_REFRESH_S / 2
    assert not board.tree_is_stale()
    clock.now += TREE_REFRESH_S / 2
    assert board.tree_is_stale()
