"""HiRadixCache without a model: pages demoted to the tier, matched there, loaded back,
the tier's own LRU, write policies, integrity of both tiers (the saved index:
test_hiradix_restart.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_kv_events import replay, tree_prefixes
from test_radix_cache_state_machine import NAMESPACES, TOKENS

from radixserve.cache.hiradix_cache import HiRadixCache
from radixserve.cache.host_tier import HostTier, TierLayout
from radixserve.cache.kv_events import BlockRemoved, KVEventSink
from radixserve.cache.kv_pool import KVPool, PoolShape
from radixserve.cache.prefix_cache import CacheIntegrityError

PAGE = 4
LAYOUT = TierLayout(num_layers=2, page_size=PAGE, num_kv_heads=2, head_dim=8, dtype="float32")


def _cache(
    pool_pages=9, tier_slots=16, policy="write_through", folder=None, fingerprint="m", events=None
):
    shape = PoolShape(
        num_layers=2, num_pages=pool_pages, page_size=PAGE, num_kv_heads=2, head_dim=8
    )
    pool = KVPool(shape, torch.float32, "cpu")
    tier = HostTier(LAYOUT, tier_slots, folder)
    return HiRadixCache(pool, tier, policy, fingerprint, events)


def _computed(cache: HiRadixCache, tokens: list[int]) -> list[int]:
    """Pages holding `tokens`' 'KV' (a value derived from the tokens), inserted into the tree."""
    pages = cache.allocator.allocate(len(tokens) // PAGE).tolist()
    for i, page in enumerate(pages):
        value = float(sum(tokens[: (i + 1) * PAGE]))
        cache.pool.write_pages([page], torch.full((1, *LAYOUT.page_shape), value))
    present = cache.insert(tokens, pages)
    cache.allocator.free(pages[: present // PAGE])
    return pages


def _kv_values(cache: HiRadixCache, pages: list[int]) -> list[float]:
    return cache.pool.read_pages(pages)[:, 0, 0, 0, 0, 0].tolist()


def _expected(tokens: list[int]) -> list[float]:
    return [float(sum(tokens[: (i + 1) * PAGE])) for i in range(len(tokens) // PAGE)]


def _ensure_free(cache):
    def ensure(num: int) -> bool:
        short = num - cache.allocator.num_free
        if short > 0:
            cache.evict(short)
        return cache.allocator.num_free >= num

    return ensure


def _load(cache, tokens):
    match = cache.match_prefix(tokens, max_tokens=len(tokens))
    cache.lock(match.node)
    loaded = cache.load_back(match, _ensure_free(cache))
    cache.lock(loaded.node)
    cache.unlock(match.node)
    return loaded


SEQ_A = list(range(1, 17))  # 4 pages
SEQ_B = list(range(100, 116))


def test_evicted_pages_are_demoted_matched_in_the_tier_and_loaded_back_intact():
    cache = _cache()
    _computed(cache, SEQ_A)
    assert cache.evict(4) == 4  # all of A leaves the pool...
    match = cache.match_prefix(SEQ_A, max_tokens=16)
    assert (match.num_tokens, match.host_tokens) == (0, 16)  # ...but not the tree
    cache.check_integrity()
    loaded = _load(cache, SEQ_A)
    assert (loaded.num_tokens, loaded.host_tokens) == (16, 0)
    assert _kv_values(cache, loaded.pages) == _expected(SEQ_A)
    assert cache.tier_stats()["hicache_pages_to_device"] == 4
    cache.check_integrity(held_pages=[])
    cache.unlock(loaded.node)
    cache.check_integrity()


def test_a_partial_load_stops_where_the_pool_runs_out():
    cache = _cache(pool_pages=7)  # 6 usable pages
    _computed(cache, SEQ_A[:12])
    _computed(cache, SEQ_A[:8] + [99] * 4)  # splits A after 2 pages
    cache.evict(4)
    held = cache.allocator.allocate(4).tolist()  # a running request holds 4 of 6 pages
    loaded = _load(cache, SEQ_A[:12])
    assert (loaded.num_tokens, loaded.host_tokens) == (8, 4)  # the last page found no room
    assert _kv_values(cache, loaded.pages) == _expected(SEQ_A[:8])
    cache.unlock(loaded.node)
    cache.check_integrity(held_pages=held)


def test_insert_over_tier_only_nodes_adopts_the_new_pages():
    cache = _cache()
    _computed(cache, SEQ_A)
    cache.evict(4)
    pages = _computed(cache, SEQ_A + list(range(17, 21)))  # recomputed by someone else
    match = cache.match_prefix(SEQ_A, max_tokens=16)
    assert match.num_tokens == 16 and match.pages == pages[:4]
    cache.check_integrity()


def test_the_tier_lru_drops_the_least_recently_used_tier_only_leaf():
    cache = _cache(pool_pages=9, tier_slots=8, policy="write_back")
    _computed(cache, SEQ_A)
    _computed(cache, SEQ_B)
    cache.evict(8)  # both demoted: the tier is full
    cache.match_prefix(SEQ_A, max_tokens=16)  # A used more recently than B
    _computed(cache, list(range(200, 216)))
    cache.evict(4)  # C needs tier room: B goes
    assert cache.match_prefix(SEQ_B, max_tokens=16).host_tokens == 0
    assert cache.match_prefix(SEQ_A, max_tokens=16).host_tokens == 16
    cache.check_integrity()


def test_without_tier_room_a_node_is_dropped_as_before():
    cache = _cache(tier_slots=2, policy="write_back")
    _computed(cache, SEQ_A)
    assert cache.evict(4) == 4
    match = cache.match_prefix(SEQ_A, max_tokens=16)
    assert match.num_tokens == match.host_tokens == 0
    cache.check_integrity()


@pytest.mark.parametrize(
    ("policy", "copied_at_insert"),
    [("write_through", 4), ("write_back", 0), ("write_through_selective", 0)],
)
def test_write_policies_copy_at_their_moment(policy, copied_at_insert):
    cache = _cache(policy=policy)
    _computed(cache, SEQ_A)
    assert cache.tier_stats()["hicache_pages_to_host"] == copied_at_insert
    if policy == "write_through_selective":
        node = cache.match_prefix(SEQ_A, max_tokens=16).node
        cache.record_hit(node)
        assert cache.tier_stats()["hicache_pages_to_host"] == 0
        cache.record_hit(node)
        assert cache.tier_stats()["hicache_pages_to_host"] == 4
    cache.evict(4)
    assert cache.match_prefix(SEQ_A, max_tokens=16).host_tokens == 16
    assert cache.tier_stats()["hicache_bytes_to_host"] == 4 * LAYOUT.page_nbytes


def test_kv_events_describe_the_tree_across_both_tiers():
    events: list = []
    cache = _cache(
        tier_slots=8, policy="write_back", events=KVEventSink(PAGE, "CPU", events.append)
    )
    _computed(cache, SEQ_A)
    _computed(cache, SEQ_B)
    cache.evict(8)  # demoted, still in the tree: nothing removed
    assert not any(isinstance(e, BlockRemoved) for e in events)
    assert replay(events) == tree_prefixes(cache)
    _load(cache, SEQ_A)
    _computed(cache, list(range(200, 216)))
    cache.evict(4)  # the tier makes room: B leaves the tree
    assert [type(e) for e in events[-1:]] == [BlockRemoved]
    assert replay(events) == tree_prefixes(cache) and len(replay(events)) == 8


def test_integrity_catches_a_leaked_slot_and_a_rotten_page():
    cache = _cache()
    _computed(cache, SEQ_A)
    cache.check_integrity()
    slot = cache.tier.allocate(1)
    with pytest.raises(CacheIntegrityError, match="tier slots leaked"):
        cache.check_integrity()
    cache.tier.free(slot)
    cache.tier.data[0, 3] ^= 0x10
    with pytest.raises(CacheIntegrityError, match="checksum"):
        cache.check_integrity()


def _host_only(cache: HiRadixCache) -> int:
    return cache.tier_stats()["hicache_host_only_pages"]


def test_tier_only_pages_are_counted_as_they_move_not_walked_for():
    cache = _cache(pool_pages=9, tier_slots=8)
    _computed(cache, SEQ_A)
    assert _host_only(cache) == 0  # written through: in both tiers
    cache.evict(4)
    assert _host_only(cache) == 4  # demoted
    loaded = _load(cache, SEQ_A[:8])  # the first 2 pages come back (a split)
    assert _host_only(cache) == 2
    cache.unlock(loaded.node)
    _computed(cache, SEQ_A + list(range(17, 21)))  # an insert adopts the other 2
    assert _host_only(cache) == 0
    cache.evict(8)
    _computed(cache, SEQ_B)  # written through: the tier LRU drops A's last page
    cache.evict(4)
    assert _host_only(cache) == 8  # A (its last page dropped for B) and B, demoted
    assert cache.match_prefix(SEQ_A + list(range(17, 21)), max_tokens=20).host_tokens == 16
    cache.check_integrity()
    cache._num_tier_only += 1
    with pytest.raises(CacheIntegrityError, match="tier-only pages"):
        cache.check_integrity()
    cache.reset()
    assert _host_only(cache) == 0


def test_the_tree_summary_and_outline_tell_tier_only_tokens_apart():
    cache = _cache()
    _computed(cache, SEQ_A)
    loaded = _load(cache, SEQ_A[:8])  # holds A's first 2 pages in the pool
    cache.evict(2)  # only A's last 2 pages can leave
    summary = cache.tree_summary()
    assert (summary.num_tokens, summary.num_host_only_tokens) == (16, 8)
    assert summary.largest_subtrees[0].num_host_only_tokens == 8
    top = cache.tree_outline()["children"][0]
    assert (top["tokens"], top["host_only"]) == (8, False)
    assert [(c["tokens"], c["host_only"]) for c in top["children"]] == [(8, True)]
    cache.unlock(loaded.node)


def test_reset_frees_both_tiers():
    cache = _cache()
    _computed(cache, SEQ_A)
    cache.evict(2)
    cache.reset()
    assert cache.tier.num_free == cache.tier.num_slots
    assert cache.allocator.num_free == cache.allocator.capacity
    cache.check_integrity()


# ---- warm restart ----


# ---- random lifecycles ----


class HiCacheMachine(RuleBasedStateMachine):
    """Requests match (loading tier pages back), run holding their lock, insert and leave,
    under every write policy and a pool and tier too small for them: every page a match
    hands out holds exactly its prefix's KV, and both tiers' accounting holds throughout."""

    @initialize(policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]))
    def setup(self, policy):
        self.cache = _cache(pool_pages=8, tier_slots=10, policy=policy)
        self.running: list[tuple[object, list[int]]] = []  # (locked node, own pages)

    def _value(self, namespace, prefix) -> float:
        return float(hash((namespace, tuple(prefix))) % (1 << 20))

    def _check_pages(self, tokens, namespace, pages) -> None:
        values = _kv_values(self.cache, pages)
        for i, value in enumerate(values):
            assert value == self._value(namespace, tokens[: (i + 1) * PAGE])

    @rule(tokens=TOKENS, namespace=NAMESPACES, keep=st.booleans())
    def request(self, tokens, namespace, keep):
        tokens = [t % 7 for t in tokens] * 2  # short alphabet: shared prefixes, splits
        match = self.cache.match_prefix(tokens, namespace, max_tokens=len(tokens))
        self.cache.lock(match.node)
        loaded = self.cache.load_back(match, _ensure_free(self.cache))
        self.cache.lock(loaded.node)
        self.cache.unlock(match.node)
        assert loaded.num_tokens >= match.num_tokens
        self._check_pages(tokens, namespace, loaded.pages)
        own = self._compute(tokens, namespace, loaded)
        if keep:
            self.running.append((loaded.node, own))
        else:
            self._finish(loaded.node, own)

    def _compute(self, tokens, namespace, loaded) -> list[int]:
        """Own pages for the uncached whole pages (as many as can be had), KV written,
        inserted into the tree; returns the pages the request still owns (the duplicates)."""
        num = len(tokens) // PAGE - len(loaded.pages)
        if not _ensure_free(self.cache)(num):
            return []
        own = self.cache.allocator.allocate(num).tolist()
        for i, page in enumerate(own):
            end = (len(loaded.pages) + i + 1) * PAGE
            kv = torch.full((1, *LAYOUT.page_shape), self._value(namespace, tokens[:end]))
            self.cache.pool.write_pages([page], kv)
        pages = loaded.pages + own
        present = self.cache.insert(tokens[: len(pages) * PAGE], pages, namespace)
        return own[: max(present // PAGE - len(loaded.pages), 0)]

    def _finish(self, node, own) -> None:
        self.cache.allocator.free(own)
        self.cache.unlock(node)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_one(self, data):
        index = data.draw(st.integers(0, len(self.running) - 1))
        self._finish(*self.running.pop(index))

    @rule(num=st.integers(1, 6))
    def evict(self, num):
        self.cache.evict(num)

    @rule(tokens=TOKENS, namespace=NAMESPACES)
    def hit(self, tokens, namespace):
        match = self.cache.match_prefix([t % 7 for t in tokens] * 2, namespace)
        if match.num_tokens:
            self.cache.record_hit(match.node)

    @invariant()
    def both_tiers_consistent(self):
        if hasattr(self, "cache"):
            self.cache.check_integrity([p for _, own in self.running for p in own])

    def teardown(self):
        if hasattr(self, "cache"):
            for node, own in self.running:
                self._finish(node, own)
            self.cache.reset()
            assert self.cache.allocator.num_free == self.cache.allocator.capacity
            assert self.cache.tier.num_free == self.cache.tier.num_slots


HiCacheMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
test_hicache_state_machine = HiCacheMachine.TestCase
