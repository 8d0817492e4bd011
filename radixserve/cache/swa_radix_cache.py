"""SWARadixCache: the radix tree over a HybridKVPool, exact for sliding-window layers (after
SGLang's SWARadixCache).

A node keeps its pages' global K/V as RadixCache does; the sliding K/V of each page may be
tombstoned (`HybridPageAllocator.free_sliding`) while the global stays. A request resuming
at length L reads the sliding K/V of positions [L - window, L) only, so:

    tree:  [ S S S S | S S S S ] -> [ x x x x | S S S S ]     x: tombstoned sliding page
             system prompt node      conversation node         (window: 2 pages here)
    match_usable: the longest L <= the match whose pages in [L - window, L) all have their
                  sliding K/V; the request recomputes from there (every layer).
    insert:       a recomputed page revives the tombstone of the tree's page (its sliding
                  page moves over) instead of duplicating the global page.
    evict:        sliding pages first (sparing the window above every lock or pin): the
                  pages before each node's last window, then those last windows (LRU over
                  nodes, inner ones too), then RadixCache's leaf eviction for global pages.
    dead ends:    after tombstoning, what a leaf holds past the last hit that can end in
                  it (all of it when none can) leaves the tree with its global pages, then
                  so may its parent: as SGLang deletes its tombstoned leaves. KV events say
                  BlockRemoved for those pages, so every path a router sees end is a hit; a
                  tombstone inside the tree stays silent, as in SGLang (#24718): its pages
                  still serve the hits that resume past it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixserve.cache.prefix_cache import CacheIntegrityError, MatchResult
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.swa_pool import HybridPageAllocator
from radixserve.cache.tree_node import TreeNode, evict_key, is_evictable

if TYPE_CHECKING:
    from radixserve.cache.kv_events import KVEventSink


class SWARadixCache(RadixCache):
    """RadixCache whose pages' sliding K/V may be tombstoned; see the module docstring."""

    def __init__(
        self,
        allocator: HybridPageAllocator,
        page_size: int,
        window: int,
        events: KVEventSink | None = None,
    ):
        self.window = window
        self._window_pages = -(-window // page_size)  # the pages a hit's window reads, at most
        super().__init__(allocator, page_size, events)
        self.num_tombstoned = 0  # sliding pages tombstoned, ever

    def _clear(self) -> None:
        super()._clear()
        self._num_live_sliding = 0  # tree pages that have their sliding K/V

    # ---- match / insert ----

    def match_usable(
        self,
        token_ids: Sequence[int],
        namespace: str | None = None,
        max_tokens: int | None = None,
    ) -> MatchResult:
        match = self.match_prefix(token_ids, namespace, max_tokens)
        usable = self._resumable_pages(match.pages)
        if usable == len(match.pages):
            return match
        return self.match_prefix(token_ids, namespace, max_tokens=usable * self.page_size)

    def _resumable_pages(self, pages: list[int]) -> int:
        """The most leading pages k such that pages covering [k * page_size - window,
        k * page_size) all have their sliding K/V."""
        if not pages:
            return 0
        dead = np.flatnonzero(~self.allocator.is_live(pages).numpy())
        if not len(dead):
            return len(pages)
        for k in range(len(pages), 0, -1):
            first = max(0, k * self.page_size - self.window) // self.page_size
            num_dead_before = int(np.searchsorted(dead, k))
            if num_dead_before == 0 or dead[num_dead_before - 1] < first:
                return k
        return 0

    def _take_pages_on_path(self, node: TreeNode, num_cached: int, pages: Sequence[int]) -> int:
        """Revives the path's tombstoned pages with the caller's sliding K/V of the same
        tokens (the caller then frees its duplicate pages, global K/V only)."""
        tree = torch.as_tensor(self._path_pages(node), dtype=torch.int64)
        if not tree.numel():
            return num_cached
        own = torch.as_tensor([int(p) for p in pages[: tree.numel()]], dtype=torch.int64)
        revive = (tree != own) & ~self.allocator.is_live(tree) & self.allocator.is_live(own)
        if bool(revive.any()):
            self.allocator.move_sliding(own[revive], tree[revive])
            self._num_live_sliding += int(revive.sum())
        return num_cached

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int]) -> TreeNode:
        leaf = super()._add_leaf(parent, key, pages)
        self._num_live_sliding += int(self.allocator.is_live(pages).sum())
        return leaf

    def _detach_leaf(self, leaf: TreeNode) -> list[int]:
        pages = super()._detach_leaf(leaf)
        self._num_live_sliding -= int(self.allocator.is_live(pages).sum())
        return pages

    # ---- evict ----

    def evict(self, num_pages: int) -> int:
        """Frees sliding pages (tombstones) and then global pages (leaf eviction) until
        `num_pages` more pages with both are free; returns sliding + global pages freed."""
        allocator = self.allocator
        target = allocator.num_free + num_pages
        tombstoned = freed = 0
        if allocator.sliding.num_free < target:
            tombstoned = self._tombstone(target - allocator.sliding.num_free)
            freed = self._drop_dead_ends()
        if allocator.num_free_global < target:
            freed += super().evict(target - allocator.num_free_global)
        return tombstoned + freed

    def _tombstone(self, num_pages: int) -> int:
        """Frees the sliding K/V of pages no lock or pin reads: first the pages before each
        node's last window (least recently used nodes first), then those last windows,
        where the hits that resume at a node's end read."""
        spared = self._spared()
        tail = -(-self.window // self.page_size) + 1  # pages a window ending at the end spans
        heap = []
        for node in self._nodes():
            if node.parent is None:
                continue
            candidates = node.pages[: spared.get(node, len(node.pages))]
            head = max(0, len(node.pages) - tail)
            for rank, pages in enumerate((candidates[:head], candidates[head:])):
                if pages and bool(self.allocator.is_live(pages).any()):
                    heap.append((rank, *evict_key(node), pages))
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            freed += self.allocator.free_sliding(heapq.heappop(heap)[-1])
        self._num_live_sliding -= freed
        self.num_tombstoned += freed
        return freed

    def _drop_dead_ends(self) -> int:
        """Detaches what evictable leaves hold past the last hit they can end (all of a leaf
        that ends none, then its parent if it becomes such a leaf); frees those pages and
        returns how many."""
        stack = [leaf for leaf in self._leaves if is_evictable(leaf)]
        freed: list[int] = []
        while stack:
            leaf = stack.pop()
            keep = self._num_ending_pages(leaf)
            if keep == len(leaf.pages):
                continue
            if keep:
                self._split(leaf, keep * self.page_size)  # `leaf` keeps the dead end
            freed += self._detach_leaf(leaf)
            parent = leaf.parent
            if not keep and parent in self._leaves and is_evictable(parent):
                stack.append(parent)
        self.allocator.free(freed)
        return len(freed)

    def _num_ending_pages(self, leaf: TreeNode) -> int:
        """How many of `leaf`'s pages lead up to the last hit that can end in it (match_usable:
        its window's sliding K/V all there); 0: no hit ends in it."""
        if bool(self.allocator.is_live(self._last_pages(leaf, self._window_pages)).all()):
            return len(leaf.pages)  # the common case: a hit ends at the leaf's end
        path = self._path_pages(leaf)
        above = len(path) - len(leaf.pages)
        return max(0, self._resumable_pages(path) - above)

    @staticmethod
    def _last_pages(node: TreeNode, num: int) -> list[int]:
        """The last `num` pages of the path from the root to `node` (fewer if it is shorter)."""
        runs: list[list[int]] = []
        while node.parent is not None and num > 0:
            runs.append(node.pages[-num:])
            num -= len(runs[-1])
            node = node.parent
        return [p for run in reversed(runs) for p in run]

    def _spared(self) -> dict[TreeNode, int]:
        """For each node holding part of the window above a lock's or pin's end: the index
        of its first page in that window (its pages from there on keep their sliding K/V)."""
        spared: dict[TreeNode, int] = {}
        for node in self._nodes():
            if node.parent is None or not _holds_end(node):
                continue
            remaining, n = self.window, node
            while n.parent is not None and remaining > 0:
                first = max(0, len(n.key) - remaining) // self.page_size
                spared[n] = min(spared.get(n, len(n.pages)), first)
                remaining -= len(n.key)
                n = n.parent
        return spared

    def num_evictable_pages(self) -> int:
        allocator = self.allocator
        global_pages = allocator.num_free_global + super().num_evictable_pages()
        sliding_pages = allocator.sliding.num_free + self._num_live_sliding
        return max(0, min(global_pages, sliding_pages) - allocator.num_free)

    # ---- sizes and checks ----

    def tier_stats(self) -> dict[str, int]:
        sliding = self.allocator.sliding
        return {
            "swa_pool_capacity_pages": sliding.capacity,
            "swa_pool_free_pages": sliding.num_free,
            "swa_tree_live_pages": self._num_live_sliding,
            "swa_tombstoned_pages": self.num_tombstoned,
        }

    def check_integrity(self, held_pages: Iterable[int] = ()) -> None:
        super().check_integrity(held_pages)  # both page spaces (check_page_accounting)
        live = sum(int(self.allocator.is_live(n.pages).sum()) for n in self._nodes() if n.pages)
        if live != self._num_live_sliding:
            raise CacheIntegrityError(
                f"the tree counts {self._num_live_sliding} pages with sliding K/V; it holds {live}"
            )


def _holds_end(node: TreeNode) -> bool:
    """A lock or pin ends at `node` (more of them than its children's)."""
    children = node.children.values()
    return node.lock_count > sum(c.lock_count for c in children) or node.pin_count > sum(
        c.pin_count for c in children
    )
