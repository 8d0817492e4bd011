"""HiRadixCache: the radix cache over two tiers, the KV pool and a HostTier below it.

A node's pages live in the pool (`pages`), in the tier (`host_slots`), or both. Pool-resident
nodes form the top of the tree: a node in the pool never hangs below a tier-only one.

    root ── A (pool+tier) ──┬── B (pool)          evict from the pool: device leaves (pool
                            └── C (tier only)     nodes with no pool child: B), LRU first;
                                  └── D (tier)    a node with a tier copy is demoted (C, D),
                                                  one without is dropped with its subtree

    write_through            copy a node to the tier when it enters the tree
    write_through_selective  copy once its hit count reaches SELECTIVE_MIN_HITS
    write_back               copy when it is evicted from the pool

`match_prefix` reports the pool part (pages, node to lock) and, beyond it, `host_tokens`;
`load_back` copies those into freshly allocated pool pages, node by node from the top, before
the request runs. The tier has its own LRU: when a copy needs slots, tier-only leaves go,
lowest priority and least recently matched first; a locked path (a load in progress) never.
Without room a node simply stays pool-only. `insert` over tier-only nodes gives them the
caller's freshly computed pages instead (their tier copy stays valid: same tokens, same KV).

With a folder, `close` (and every PERSIST_INTERVAL_S while the tier changes) saves an index
of the tier's nodes (cache/tier_index.py); a restart rebuilds them as tier-only nodes. A
failing tier write (disk full, I/O error) never fails a step: `writes` backs off and counts.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from radixserve.cache.host_tier import HostTier, check_slot_accounting, create_host_tier
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.prefix_cache import CacheIntegrityError, MatchResult
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tier_index import (
    TierEntry,
    load_tier_index,
    save_tier_index,
    tier_entries,
    tier_identity,
)
from radixserve.cache.tier_writes import TierWriteGuard
from radixserve.cache.tree_node import (
    RootNode,
    TreeNode,
    deepest_in_pool,
    depth,
    evict_key,
    has_pool_child,
    is_evictable,
    is_tier_evictable,
    num_tier_only,
    tier_path,
)
from radixserve.config import HiCacheConfig

if TYPE_CHECKING:  # msgspec (the events' structs) is needed only with events on
    from radixserve.cache.kv_events import KVEventSink

logger = logging.getLogger(__name__)

SELECTIVE_MIN_HITS = 2  # write_through_selective: SGLang writes through at the second hit
PERSIST_INTERVAL_S = 30.0  # at most this long between index saves while the tier changes
INDEX_FILE = "kv_tier_index.json"


class HiRadixCache(RadixCache):
    """A RadixCache whose evicted pages go to a HostTier and come back on a hit."""

    def __init__(
        self,
        pool: KVPool,
        tier: HostTier,
        write_policy: str,
        model_fingerprint: str = "",
        events: KVEventSink | None = None,
    ):
        """`model_fingerprint`: names the model whose KV the tier holds (a saved tier of
        another fingerprint is discarded at start). `events` describe the tree across both
        tiers: a node entering or leaving the tree is an event, a move between the pool and
        the tier is not (the prefix stays servable without recomputing)."""
        self.pool = pool
        self.tier = tier
        self.write_policy = write_policy
        self.identity = tier_identity(tier, model_fingerprint)
        self.pages_to_host = 0
        self.pages_to_device = 0
        self._last_persist = time.monotonic()
        self.writes = TierWriteGuard()
        super().__init__(pool.allocator, pool.page_size, events)
        if tier.folder is not None:
            self._restore()

    def _clear(self) -> None:
        super()._clear()
        self._device_leaves: set[TreeNode] = set()  # pool nodes without a pool child
        self._num_tier_only = 0  # pages of tier-only nodes, kept as they move (tier_stats)

    def reset(self) -> None:
        slots = [s for n in self._nodes() if n.host_slots for s in n.host_slots]
        super().reset()
        self.tier.free(slots)

    # ---- match / insert ----

    def match_prefix(
        self,
        token_ids: Sequence[int],
        namespace: str | None = None,
        max_tokens: int | None = None,
    ) -> MatchResult:
        match = super().match_prefix(token_ids, namespace, max_tokens)
        node = match.node
        if node.parent is None or node.pages:
            return match
        device = deepest_in_pool(node)
        num_host = sum(len(n.key) for n in tier_path(node, device))
        return MatchResult(
            pages=match.pages,
            num_tokens=match.num_tokens - num_host,
            node=device,
            host_tokens=num_host,
            host_node=node,
        )

    def _take_pages_on_path(self, node: TreeNode, num_cached: int, pages: Sequence[int]) -> int:
        path = tier_path(node, deepest_in_pool(node))
        start = num_cached - sum(len(n.key) for n in path)
        first = start // self.page_size
        for n in reversed(path):  # top down
            last = first + len(n.key) // self.page_size
            self._set_pool_pages(n, [int(p) for p in pages[first:last]])
            first = last
        return start

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int]) -> TreeNode:
        leaf = super()._add_leaf(parent, key, pages)
        self._refresh_device_leaf(leaf)
        self._refresh_device_leaf(parent)
        if pages and self.write_policy == "write_through":
            self._backup(leaf)
        return leaf

    def record_hit(self, node: object) -> None:
        super().record_hit(node)
        if self.write_policy == "write_through_selective":
            for n in reversed(list(node.path_to_root())):
                if n.hit_count >= SELECTIVE_MIN_HITS and n.host_slots is None and n.pages:
                    self._backup(n)

    # ---- pool <-> tier ----

    def load_back(self, match: MatchResult, ensure_free: Callable[[int], bool]) -> MatchResult:
        host = match.host_node
        if not match.host_tokens or host.evicted:  # a stale match: the tier dropped it
            return MatchResult(pages=match.pages, num_tokens=match.num_tokens, node=match.node)
        path = list(reversed(tier_path(host, match.node)))
        self.lock(host)  # the tier LRU and pool eviction keep off the path
        loaded = match.node
        try:
            for node in path:
                if node.pages:  # a match from before another request loaded it
                    loaded = node
                    continue
                if not ensure_free(len(node.host_slots)):
                    break
                pages = self.allocator.allocate(len(node.host_slots)).tolist()
                self.pool.write_pages(pages, self.tier.read(node.host_slots))
                self.pages_to_device += len(pages)
                self._set_pool_pages(node, pages)
                loaded = node
        finally:
            self.unlock(host)
        num_tokens = depth(loaded)
        rest = depth(host) - num_tokens
        return MatchResult(
            pages=self._path_pages(loaded),
            num_tokens=num_tokens,
            node=loaded,
            host_tokens=rest,
            host_node=host if rest else None,
        )

    def _backup(self, node: TreeNode) -> bool:
        """Copies a pool node's pages into tier slots (making room by the tier's LRU); a
        write error gives the copy up and backs off (cache/tier_writes.py)."""
        if not self.writes.allows_write() or not self._make_tier_room(len(node.pages)):
            return False
        slots = self.tier.allocate(len(node.pages))
        kv = self.pool.read_pages(node.pages)
        if not self.writes.attempt("copying pages to the tier", self.tier.write, slots, kv):
            self.tier.free(slots)
            return False
        node.host_slots = slots
        self.pages_to_host += len(slots)
        self._tier_changed()
        return True

    def _make_tier_room(self, num_slots: int) -> bool:
        """Drops tier-only leaves, LRU first, until `num_slots` slots are free."""
        if num_slots <= self.tier.num_free:
            return True
        if num_slots > self.tier.num_slots:
            return False
        heap = [evict_key(n) for n in self._leaves if is_tier_evictable(n)]
        heapq.heapify(heap)
        while self.tier.num_free < num_slots and heap:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            self._drop_leaf(node)
            if not parent.children and is_tier_evictable(parent):
                heapq.heappush(heap, evict_key(parent))
        return self.tier.num_free >= num_slots

    def _set_pool_pages(self, node: TreeNode, pages: list[int]) -> None:
        """Gives a node pool pages (loaded, adopted) or takes them (`[]`: demoted)."""
        self._account(node, -1)
        self._num_tier_only -= num_tier_only(node)
        self._num_total += len(pages) - len(node.pages)
        node.pages = pages
        self._account(node, 1)
        self._num_tier_only += num_tier_only(node)
        self._refresh_device_leaf(node)
        self._refresh_device_leaf(node.parent)

    def _refresh_device_leaf(self, node: TreeNode) -> None:
        if node.parent is not None and node.pages and not has_pool_child(node):
            self._device_leaves.add(node)
        else:
            self._device_leaves.discard(node)

    # ---- evict ----

    def evict(self, num_pages: int) -> int:
        heap = [evict_key(n) for n in self._device_leaves if is_evictable(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            if node not in self._device_leaves:  # pushed twice: gone already
                continue
            parent = node.parent
            freed += self._evict_from_pool(node)
            if parent in self._device_leaves and is_evictable(parent):
                heapq.heappush(heap, evict_key(parent))
        self.allocator.free(freed)
        return len(freed)

    def _evict_from_pool(self, node: TreeNode) -> list[int]:
        """Demotes a device leaf to the tier (copying it first under write_back), or drops
        it with its tier-only subtree when it has no tier copy; returns its pool pages."""
        if node.host_slots is None and self.write_policy == "write_back":
            self._backup(node)
        pages = node.pages
        if node.host_slots is not None:
            self._set_pool_pages(node, [])
            return pages
        for child in list(node.children.values()):
            self._drop_subtree(child)
        return self._detach_leaf(node)

    def _drop_subtree(self, node: TreeNode) -> None:
        """Drops a tier-only subtree, leaves first."""
        for child in list(node.children.values()):
            self._drop_subtree(child)
        self._drop_leaf(node)

    def _drop_leaf(self, node: TreeNode) -> None:
        """Takes a tier-only leaf out of the tree and frees its slots."""
        self._num_tier_only -= num_tier_only(node)
        self.tier.free(node.host_slots)
        node.host_slots = None
        self._detach_leaf(node)
        self._tier_changed()

    def _detach_leaf(self, leaf: TreeNode) -> list[int]:
        pages = super()._detach_leaf(leaf)
        self._device_leaves.discard(leaf)
        self._refresh_device_leaf(leaf.parent)
        return pages

    # ---- sizes and checks ----

    def tier_stats(self) -> dict[str, Any]:
        """Counters kept as pages move (no walk: a metrics scrape calls this)."""
        return {
            "hicache_capacity_pages": self.tier.num_slots,
            "hicache_used_pages": self.tier.num_slots - self.tier.num_free,
            "hicache_host_only_pages": self._num_tier_only,
            "hicache_pages_to_host": self.pages_to_host,
            "hicache_pages_to_device": self.pages_to_device,
            "hicache_bytes_to_host": self.tier.bytes_written,
            "hicache_bytes_to_device": self.tier.bytes_read,
            **self.writes.stats(),
        }

    def _check_pages(self, node: TreeNode) -> None:
        if node.parent is None:
            return super()._check_pages(node)
        num_pages = len(node.key) // self.page_size
        if node.pages:
            super()._check_pages(node)
            if not node.parent.pages and node.parent.parent is not None:
                raise CacheIntegrityError("a pool node hangs below a tier-only node")
        elif node.host_slots is None:
            raise CacheIntegrityError("a node has neither pool pages nor tier slots")
        elif node.lock_count or node.pin_count:
            raise CacheIntegrityError("a tier-only node is locked or pinned")
        if node.host_slots is not None and len(node.host_slots) != num_pages:
            raise CacheIntegrityError(
                f"node has {len(node.host_slots)} tier slots for {num_pages} pages"
            )

    def check_integrity(self, held_pages: Iterable[int] = ()) -> None:
        super().check_integrity(held_pages)
        nodes = list(self._nodes())
        expected = {n for n in nodes if n.parent is not None and n.pages and not has_pool_child(n)}
        if self._device_leaves != expected:
            raise CacheIntegrityError("the set of device leaves disagrees with the tree")
        tier_only = sum(num_tier_only(n) for n in nodes)
        if tier_only != self._num_tier_only:
            raise CacheIntegrityError(
                f"tier-only pages: {self._num_tier_only} counted, {tier_only} in the tree"
            )
        check_slot_accounting(self.tier, [s for n in nodes if n.host_slots for s in n.host_slots])

    # ---- persistence ----

    def close(self) -> None:
        if self.tier.folder is not None:
            self.writes.attempt("saving the tier index", self.persist)
        self.tier.close()

    def persist(self) -> None:
        """Saves the index of tier nodes (and flushes the tier file) for a warm restart."""
        self.tier.flush()
        save_tier_index(
            self._index_path(), self.identity, self.tier, tier_entries(self.roots(), self.tier)
        )
        self._last_persist = time.monotonic()

    def _tier_changed(self) -> None:
        due = time.monotonic() - self._last_persist >= PERSIST_INTERVAL_S
        if self.tier.folder is not None and due and self.writes.allows_write():
            self.writes.attempt("saving the tier index", self.persist)

    def _index_path(self) -> str:
        return os.path.join(self.tier.folder, INDEX_FILE)

    def _restore(self) -> None:
        """Rebuilds tier-only nodes from a saved index; a mismatched or broken one is
        discarded with a warning (tier_index.py), a node failing its checksum dropped."""
        entries = load_tier_index(self._index_path(), self.identity, self.tier)
        nodes: list[TreeNode | None] = []
        for entry in entries:
            parent = (
                self._namespaces.get(entry.namespace) if entry.parent < 0 else nodes[entry.parent]
            )
            nodes.append(None if parent is None else self._restore_node(parent, entry))
        if entries:
            restored = sum(len(n.key) for n in nodes if n is not None)
            logger.info("hicache: %d cached tokens restored from %s", restored, self.tier.folder)

    def _restore_node(self, parent: TreeNode, entry: TierEntry) -> TreeNode | None:
        key = tuple(entry.key)
        if key[: self.page_size] in parent.children:
            return None  # a duplicate (a hand-edited index): skipped with what is below
        if isinstance(parent, RootNode):
            self._namespaces.keep(parent)
        self.tier.claim(entry.slots)
        node = self._add_leaf(parent, key, [])
        node.host_slots = list(entry.slots)
        self._num_tier_only += num_tier_only(node)
        return node


def create_hierarchical_cache(
    pool: KVPool, config: HiCacheConfig, model_fingerprint: str, events: KVEventSink | None = None
) -> HiRadixCache:
    """A HiRadixCache over `pool` with a tier sized and placed by `--hicache-*`."""
    tier = create_host_tier(pool, config)
    return HiRadixCache(pool, tier, config.hicache_write_policy, model_fingerprint, events)
