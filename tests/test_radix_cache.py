"""RadixCache / NoPrefixCache: unit tests plus a hypothesis state machine over random ops."""

from __future__ import annotations

import gc
import weakref

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import CacheIntegrityError, CacheSizeInfo, NoPrefixCache
from radixserve.cache.radix_cache import RadixCache, create_prefix_cache


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


# ---- match / insert ----


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


# ---- lock / evict ----


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


# ---- NoPrefixCache, factory, integrity ----


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


# ---- property test: random request lifecycles ----

# Prompts cut from a few shared stems plus a random tail, so prefixes overlap and nodes split.
STEMS = [(0, 0, 1, 1) * 3, (0, 1) * 6, (1, 0, 0, 0) * 3]
TOKENS = st.builds(
    lambda stem, cut, tail: list(stem[:cut]) + tail,
    st.sampled_from(STEMS),
    st.integers(0, 12),
    st.lists(st.integers(0, 1), max_size=6),
).filter(bool)
NAMESPACES = st.sampled_from([None, "salt"])


class CacheMachine(RuleBasedStateMachine):
    """Requests match, lock, allocate, insert, unlock and free as a scheduler would.

    `content[page]` records which (namespace, prefix) a page's KV was computed for, so every
    match can be checked to return pages holding exactly the matched prefix.
    """

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.allocator = PageAllocator(25)
        self.cache = RadixCache(self.allocator, page_size)
        self.size = page_size
        self.requests: list[dict] = []
        self.content: dict[int, tuple] = {}
        self.tree_pages: set[int] = set()
        self.pins: list[tuple] = []  # (node, pages its path held when pinned)

    def held_pages(self) -> list[int]:
        return [p for req in self.requests for p in req["own"]]

    def expected_match(self, tokens, namespace, limit) -> int:
        cached = {self.content[p] for p in self.tree_pages}
        num = 0
        while num + self.size <= limit and (namespace, tuple(tokens[: num + self.size])) in cached:
            num += self.size
        return num

    def check_match(self, tokens, namespace, result, limit) -> None:
        assert result.num_tokens == self.expected_match(tokens, namespace, limit)
        assert len(result.pages) * self.size == result.num_tokens
        for i, page in enumerate(result.pages):
            assert self.content[page] == (namespace, tuple(tokens[: (i + 1) * self.size]))

    @rule(tokens=TOKENS, namespace=NAMESPACES, max_tokens=st.none() | st.integers(0, 14))
    def match_only(self, tokens, namespace, max_tokens):
        before = self.cache.size_info()
        result = self.cache.match_prefix(tokens, namespace, max_tokens)
        limit = len(tokens) - 1 if max_tokens is None else min(max_tokens, len(tokens))
        self.check_match(tokens, namespace, result, limit // self.size * self.size)
        assert self.cache.size_info() == before

    @precondition(lambda self: len(self.requests) < 4)
    @rule(tokens=TOKENS, namespace=NAMESPACES)
    def start_request(self, tokens, namespace):
        self.start(tokens, namespace)

    @precondition(lambda self: 0 < len(self.requests) < 4)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=3))
    def start_sharing_request(self, data, tail):
        """A prompt that forks off a running one: its match may end inside a locked node."""
        req = data.draw(st.sampled_from(self.requests))
        cut = data.draw(st.integers(0, len(req["tokens"])))
        if req["tokens"][:cut] + tail:
            self.start(req["tokens"][:cut] + tail, req["ns"])

    def start(self, tokens, namespace) -> None:
        match = self.cache.match_prefix(tokens, namespace)
        limit = (len(tokens) - 1) // self.size * self.size
        self.check_match(tokens, namespace, match, limit)
        self.cache.lock(match.node)
        num_new = -(-len(tokens) // self.size) - len(match.pages)
        if not self.allocator.can_allocate(num_new):
            self.evict_checked(num_new - self.allocator.num_free)
        if not self.allocator.can_allocate(num_new):
            self.cache.unlock(match.node)
            return
        own = self.allocator.allocate(num_new).tolist()
        for i, page in enumerate(own, start=len(match.pages)):
            self.content[page] = (namespace, tuple(tokens[: (i + 1) * self.size]))
        req = dict(tokens=tokens, ns=namespace, match=match, own=own, extra_locks=0)
        self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        tokens, match, size = req["tokens"], req["match"], self.size
        num_cached = self.cache.insert(tokens, match.pages + req["own"], req["ns"])
        assert num_cached >= match.num_tokens  # a locked prefix cannot have gone away
        first_own, num_whole = len(match.pages), len(tokens) // size
        taken = req["own"][num_cached // size - first_own : num_whole - first_own]
        self.tree_pages.update(taken)
        self.allocator.free([p for p in req["own"] if p not in taken])
        for _ in range(req["extra_locks"] + 1):
            self.cache.unlock(match.node)
        again = self.cache.match_prefix(tokens, req["ns"], max_tokens=len(tokens))
        assert again.num_tokens == num_whole * size

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def lock_again(self, data):
        req = data.draw(st.sampled_from(self.requests))
        self.cache.lock(req["match"].node)
        req["extra_locks"] += 1

    @precondition(lambda self: any(req["extra_locks"] for req in self.requests))
    @rule(data=st.data())
    def unlock_extra(self, data):
        req = data.draw(st.sampled_from([r for r in self.requests if r["extra_locks"]]))
        self.cache.unlock(req["match"].node)
        req["extra_locks"] -= 1

    @precondition(lambda self: self.tree_pages and len(self.pins) < 3)
    @rule(tokens=TOKENS, namespace=NAMESPACES)
    def pin(self, tokens, namespace):
        match = self.cache.match_prefix(tokens, namespace, max_tokens=len(tokens))
        if match.num_tokens:
            self.cache.pin(match.node)
            self.pins.append((match.node, list(match.pages)))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        node, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.cache.unpin(node)

    @rule(num_pages=st.integers(0, 30))
    def evict(self, num_pages):
        self.evict_checked(num_pages)

    def evict_checked(self, num_pages: int) -> None:
        evictable = self.cache.num_evictable_pages()
        num_freed = self.cache.evict(num_pages)
        assert num_freed >= min(num_pages, evictable)
        assert self.cache.num_evictable_pages() == evictable - num_freed
        self.tree_pages -= set(self.allocator.free_pages().tolist())
        for req in self.requests:  # locked prefixes survive
            assert set(req["match"].pages) <= self.tree_pages
        for _, pages in self.pins:  # and pinned ones
            assert set(pages) <= self.tree_pages

    @invariant()
    def pages_are_accounted_for(self):
        if not hasattr(self, "cache"):
            return
        held = self.held_pages()
        self.cache.check_integrity(held)
        info = self.cache.size_info()
        assert info.total_pages == len(self.tree_pages)
        assert self.allocator.num_free + info.total_pages + len(held) == self.allocator.capacity

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for node, _ in self.pins:
            self.cache.unpin(node)
        for req in self.requests:
            for _ in range(req["extra_locks"] + 1):
                self.cache.unlock(req["match"].node)
            self.allocator.free(req["own"])
        self.cache.reset()
        assert self.allocator.num_free == self.allocator.capacity


CacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_cache_state_machine = CacheMachine.TestCase
