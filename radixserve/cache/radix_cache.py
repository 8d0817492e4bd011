"""RadixCache: a radix tree of cached KV pages keyed by token ids, at page granularity.

Every node's key is a whole number of pages; children are keyed by their first page's tokens,
so a walk compares whole pages (tuple slices), never single tokens. Each namespace (e.g. a
cache salt) has its own root, so requests of different namespaces never share a node.

    root ── (a b | c d) ──┬── (e f)           keys of page_size 2; `|` marks page edges
                          └── (g h | i j)     matching "a b c d g h x y" splits the last
                                              node into (g h) -> (i j) and returns (g h)

Each namespace's root is kept by NamespaceRoots (namespace_roots.py: live roots strongly,
empty ones weakly, so that a salt per user never piles up roots); nodes are TreeNodes
(tree_node.py). Eviction works from the `_leaves` set: its cost never depends on the number
of namespaces.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import TYPE_CHECKING

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.namespace_roots import NamespaceRoots
from radixserve.cache.prefix_cache import (
    CacheIntegrityError,
    CacheSizeInfo,
    MatchResult,
    NoPrefixCache,
    PrefixCache,
    check_enough_pages,
    check_page_accounting,
)
from radixserve.cache.swa_pool import HybridPageAllocator
from radixserve.cache.tree_node import (
    RootNode,
    TreeNode,
    evict_key,
    is_evictable,
    raise_priority,
)

if TYPE_CHECKING:  # msgspec (the events' structs) is needed only with events on
    from radixserve.cache.kv_events import KVEventSink


class RadixCache(PrefixCache):
    """Prefix cache over a radix tree; LRU eviction of unlocked leaves. With `events`, pages
    entering and leaving the tree are reported to it (cache/kv_events.py)."""

    def __init__(self, allocator: PageAllocator, page_size: int, events: KVEventSink | None = None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._events = events
        self._clear()

    def parent_of(self, node: object) -> TreeNode | None:
        return node.parent if isinstance(node, TreeNode) else None

    def reset(self) -> None:
        if self._num_protected:
            raise RuntimeError("cannot reset the radix cache while some nodes are locked")
        if self._num_pinned:
            raise RuntimeError("cannot reset the radix cache while some nodes are pinned")
        nodes = list(self._nodes())
        self.allocator.free([page for node in nodes for page in node.pages])
        for node in [*nodes, *self._namespaces.empty()]:
            node.evicted = True  # stale handles must not be locked again
        self._clear()
        if self._events:
            self._events.cleared()

    def _clear(self) -> None:
        self._namespaces = NamespaceRoots()
        self._leaves: set[TreeNode] = set()  # childless non-root nodes: eviction candidates
        self._num_evictable = 0  # pages neither locked nor pinned
        self._num_protected = 0  # pages locked by running requests
        self._num_pinned = 0  # pages pinned (locked ones too)
        self._num_total = 0
        self._clock = 0

    # ---- match / insert ----

    def match_prefix(
        self,
        token_ids: Sequence[int],
        namespace: str | None = None,
        max_tokens: int | None = None,
    ) -> MatchResult:
        limit = len(token_ids) - 1 if max_tokens is None else min(max_tokens, len(token_ids))
        limit = max(limit, 0) // self.page_size * self.page_size
        root = self._namespaces.get(namespace)
        if limit == 0 or not root.children:
            return MatchResult(pages=[], num_tokens=0, node=root)
        key = token_ids if isinstance(token_ids, tuple) else tuple(token_ids[:limit])
        node, num_tokens = self._walk(root, key, limit)
        return MatchResult(pages=self._path_pages(node), num_tokens=num_tokens, node=node)

    def insert(
        self,
        token_ids: Sequence[int],
        pages: Sequence[int],
        namespace: str | None = None,
        priority: int = 0,
    ) -> int:
        num_pages = len(token_ids) // self.page_size
        check_enough_pages(pages, num_pages)
        key = tuple(token_ids[: num_pages * self.page_size])
        root = self._namespaces.get(namespace)
        node, num_cached = self._walk(root, key)
        num_present = self._take_pages_on_path(node, num_cached, pages)
        if num_cached < len(key):
            new_pages = [int(p) for p in pages[num_cached // self.page_size : num_pages]]
            self._namespaces.keep(root)
            node = self._add_leaf(node, key[num_cached:], new_pages)
        if priority:
            raise_priority(node, priority)
        return num_present

    def _take_pages_on_path(self, node: TreeNode, num_cached: int, pages: Sequence[int]) -> int:
        """Tokens of the walked path (ending at `node`, `num_cached` long) whose pages were in
        the pool already; a tiered cache hands the caller's `pages` to path nodes that were
        only in its tier and reports less."""
        return num_cached

    def _walk(
        self, root: TreeNode, key: tuple[int, ...], end: int | None = None
    ) -> tuple[TreeNode, int]:
        """Follows `key[:end]` (`end` whole pages) down from `root`, splitting where it ends
        inside a node; touches the path. A bound instead of a slice saves copying the key.

        Returns the deepest matched node and the matched length in tokens.
        """
        self._clock += 1
        end = len(key) if end is None else end
        node, pos = root, 0
        while pos < end:
            child = node.children.get(key[pos : pos + self.page_size])
            if child is None:
                break
            num_matched = self._common_length(child.key, key, pos, end)
            if num_matched < len(child.key):
                child = self._split(child, num_matched)
            child.last_access = self._clock
            node, pos = child, pos + num_matched
        return node, pos

    def _common_length(
        self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int, end: int
    ) -> int:
        """Tokens, in whole pages, that `node_key` shares with `key[pos:end]`."""
        if pos + len(node_key) <= end and key[pos : pos + len(node_key)] == node_key:
            return len(node_key)
        size = self.page_size
        end = min(len(node_key), end - pos)
        num = size  # the first page matched: it is the child's dict key
        while num + size <= end and node_key[num : num + size] == key[pos + num : pos + num + size]:
            num += size
        return num

    def _split(self, node: TreeNode, num_tokens: int) -> TreeNode:
        """Cuts `node` after `num_tokens`; returns the new upper half (`node` keeps the rest).

        `node` stays the lower half so that handles to it still cover the same pages.
        """
        num_pages = num_tokens // self.page_size
        upper = TreeNode(node.key[:num_tokens], node.pages[:num_pages], node.parent)
        upper.lock_count, upper.pin_count = node.lock_count, node.pin_count
        upper.priority, upper.hit_count = node.priority, node.hit_count
        upper.last_access = node.last_access
        if node.host_slots is not None:
            upper.host_slots, node.host_slots = (
                node.host_slots[:num_pages],
                node.host_slots[num_pages:],
            )
        if node.block_hashes is not None:
            upper.block_hashes = node.block_hashes[:num_pages]
            node.block_hashes = node.block_hashes[num_pages:]
        node.parent.children[node.key[: self.page_size]] = upper
        node.key, node.pages, node.parent = node.key[num_tokens:], node.pages[num_pages:], upper
        upper.children[node.key[: self.page_size]] = node
        return upper

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int]) -> TreeNode:
        leaf = TreeNode(key, pages, parent)
        leaf.last_access = self._clock
        parent.children[key[: self.page_size]] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._num_evictable += len(pages)
        self._num_total += len(pages)
        if self._events:
            self._events.stored(leaf)
        return leaf

    def _path_pages(self, node: TreeNode) -> list[int]:
        runs = [n.pages for n in node.path_to_root()]
        return list(chain.from_iterable(reversed(runs)))

    def roots(self) -> list[RootNode]:
        """The roots of every namespace with pages in the tree (the default one first)."""
        return self._namespaces.live()

    def record_hit(self, node: object) -> None:
        """Counts one admitted request whose cached prefix ends at `node`, on its whole path."""
        node = self._live_node(node)
        for n in node.path_to_root():
            n.hit_count += 1

    # ---- lock / unlock, pin / unpin ----
    # A lock (running request) and a pin (retention) both count along the path to the root;
    # a node with either is never evicted. `_account` keeps the page counters in step.

    def lock(self, node: object) -> None:
        self._count_path(self._live_node(node), "lock_count", 1)

    def unlock(self, node: object) -> None:
        node = self._live_node(node)
        if node.lock_count == 0 and not node.is_root:
            raise RuntimeError("unlock of a radix cache node that is not locked")
        self._count_path(node, "lock_count", -1)

    def pin(self, node: object) -> None:
        self._count_path(self._live_node(node), "pin_count", 1)

    def unpin(self, node: object) -> None:
        node = self._live_node(node)
        if node.pin_count == 0 and not node.is_root:
            raise RuntimeError("unpin of a radix cache node that is not pinned")
        self._count_path(node, "pin_count", -1)

    def _count_path(self, node: TreeNode, counter: str, delta: int) -> None:
        for n in node.path_to_root():
            self._account(n, -1)
            setattr(n, counter, getattr(n, counter) + delta)
            self._account(n, 1)

    def _account(self, node: TreeNode, sign: int) -> None:
        """Adds (sign 1) or removes (-1) a node's pages from the counters its state selects."""
        num = sign * len(node.pages)
        if node.lock_count:
            self._num_protected += num
        if node.pin_count:
            self._num_pinned += num
        if not node.lock_count and not node.pin_count:
            self._num_evictable += num

    def _live_node(self, node: object) -> TreeNode:
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a RadixCache node handle; got {type(node).__name__}")
        if node.evicted:
            raise RuntimeError("node was evicted; lock it right after match_prefix")
        return node

    # ---- evict ----

    def evict(self, num_pages: int) -> int:
        heap = [evict_key(leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            leaf = heapq.heappop(heap)[-1]
            freed += self._detach_leaf(leaf)
            parent = leaf.parent
            if not parent.is_root and not parent.children and is_evictable(parent):
                heapq.heappush(heap, evict_key(parent))
        self.allocator.free(freed)
        return len(freed)

    def _evictable_leaves(self) -> Iterator[TreeNode]:
        return (leaf for leaf in self._leaves if is_evictable(leaf))

    def _detach_leaf(self, leaf: TreeNode) -> list[int]:
        """Takes an unlocked leaf out of the tree; returns its pages, for the caller to free."""
        self._num_evictable -= len(leaf.pages)
        self._num_total -= len(leaf.pages)
        del leaf.parent.children[leaf.key[: self.page_size]]
        leaf.evicted = True
        self._leaves.discard(leaf)
        if not leaf.parent.children and not leaf.parent.is_root:
            self._leaves.add(leaf.parent)
        if isinstance(leaf.parent, RootNode):
            self._namespaces.release_if_empty(leaf.parent)
        if self._events:
            self._events.removed(leaf)
        return leaf.pages

    # ---- sizes and checks ----

    def size_info(self) -> CacheSizeInfo:
        return CacheSizeInfo(
            evictable_pages=self._num_evictable,
            protected_pages=self._num_protected,
            total_pages=self._num_total,
            pinned_pages=self._num_pinned,
        )

    def num_pinned_pages(self) -> int:
        return self._num_pinned

    def num_evictable_pages(self) -> int:
        return self._num_evictable

    def check_integrity(self, held_pages: Iterable[int] = ()) -> None:
        for node in self._nodes():
            self._check_node(node)
        self._namespaces.check()
        self._check_counters()
        check_page_accounting(self.allocator, self._tree_pages(), held_pages)

    def _check_node(self, node: TreeNode) -> None:
        size = self.page_size
        if not node.is_root and (not node.key or len(node.key) % size):
            raise CacheIntegrityError(f"node key of {len(node.key)} tokens is not whole pages")
        self._check_pages(node)
        for first_page, child in node.children.items():
            if child.parent is not node or child.key[:size] != first_page or child.evicted:
                raise CacheIntegrityError("a child is filed under the wrong key or parent")
        for counter in ("lock_count", "pin_count"):
            children_sum = sum(getattr(child, counter) for child in node.children.values())
            if not node.is_root and getattr(node, counter) < children_sum:
                raise CacheIntegrityError(
                    f"node {counter} {getattr(node, counter)} is below its children's sum "
                    f"{children_sum}"
                )

    def _check_pages(self, node: TreeNode) -> None:
        if len(node.pages) * self.page_size != len(node.key):
            raise CacheIntegrityError(
                f"node has {len(node.pages)} pages for {len(node.key)} tokens "
                f"(page_size {self.page_size})"
            )

    def _check_counters(self) -> None:
        nodes = list(self._nodes())
        evictable = sum(len(n.pages) for n in nodes if is_evictable(n))
        protected = sum(len(n.pages) for n in nodes if n.lock_count > 0)
        pinned = sum(len(n.pages) for n in nodes if n.pin_count > 0)
        total = sum(len(n.pages) for n in nodes)
        counted = (self._num_evictable, self._num_protected, self._num_pinned, self._num_total)
        if (evictable, protected, pinned, total) != counted:
            raise CacheIntegrityError(
                f"counters say {counted} evictable / protected / pinned / total pages; the tree "
                f"holds {(evictable, protected, pinned, total)}"
            )
        if any(n.lock_count < 0 or n.pin_count < 0 for n in nodes):
            raise CacheIntegrityError("a node has a negative lock or pin count")
        if self._leaves != {n for n in nodes if not n.children and not n.is_root}:
            raise CacheIntegrityError("the set of leaves disagrees with the tree")

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node of every namespace, roots included (depth first)."""
        stack = self._namespaces.live()
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _tree_pages(self) -> Iterator[int]:
        for node in self._nodes():
            yield from node.pages


def create_prefix_cache(
    disable: bool,
    allocator: PageAllocator,
    page_size: int,
    events: KVEventSink | None = None,
    window: int | None = None,
) -> PrefixCache:
    """A RadixCache (reporting to `events`, if given; over a HybridPageAllocator the
    SWARadixCache, exact for layers sliding over `window`), or a NoPrefixCache when the radix
    cache is disabled (it caches nothing, so it has no events)."""
    if disable:
        return NoPrefixCache(allocator, page_size)
    if isinstance(allocator, HybridPageAllocator):
        from radixserve.cache.swa_radix_cache import SWARadixCache

        return SWARadixCache(allocator, page_size, window, events)
    return RadixCache(allocator, page_size, events)
