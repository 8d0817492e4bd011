"""The prefix cache interface the scheduler talks to, and its no-op implementation.

Who owns a page (the one tricky invariant). Every non-reserved page of the pool is exactly
one of: free in the allocator, owned by the cache's tree, or held by a running request.

    request's page table:  [ p0 p1 p2 | q3 q4 | q5 q6 | q7 ]     (one page per page_size tokens)
                             matched    own     own     partial last page
    match_prefix  -> p0..p2 are the tree's; the request reads them (lock the node first!)
    insert(...)   -> returns k = tokens already in the tree, say 5 pages' worth:
                     [0, k):        not taken. p0..p2 stay the tree's (do NOT free them);
                                    q3 q4 duplicate pages the tree already has: caller frees
                     [k, n):        q5 q6 now belong to the tree (n = whole pages of tokens)
                     beyond n:      q7 (a partial page) stays the caller's: caller frees it
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from radixserve.cache.kv_pool import RESERVED_PAGES, PageAllocator
from radixserve.cache.swa_pool import HybridPageAllocator
from radixserve.cache.tree_summary import TreeSummary, summarize_tree, tree_outline


class CacheIntegrityError(RuntimeError):
    """The cache's tree or the page accounting broke an invariant."""


@dataclass(frozen=True)
class MatchResult:
    """A cached prefix: its pages and the handle to lock it with."""

    pages: list[int]  # page ids of the cached prefix; len == num_tokens // page_size
    num_tokens: int  # matched tokens, a multiple of page_size
    node: object  # handle for lock()/unlock(): deepest matched node (a root if none)
    host_tokens: int = 0  # tokens past num_tokens cached in a second tier only (load_back)
    host_node: object = None  # deepest node of those, when host_tokens > 0


@dataclass(frozen=True)
class CacheSizeInfo:
    evictable_pages: int  # pages in tree nodes neither locked nor pinned
    protected_pages: int  # pages in locked nodes
    total_pages: int  # every page of the tree
    pinned_pages: int = 0  # pages in pinned nodes (locked ones too): retention


class PrefixCache(ABC):
    """Caches KV pages of token prefixes; see the module docstring for page ownership."""

    page_size: int
    allocator: PageAllocator
    shares_prefixes: bool = True  # False: insert frees pages at once, match never hits

    def parent_of(self, node: object) -> object | None:
        """The node above `node` (None at a root), for policies that walk the tree."""
        return None

    @abstractmethod
    def match_prefix(
        self,
        token_ids: Sequence[int],
        namespace: str | None = None,
        max_tokens: int | None = None,
    ) -> MatchResult:
        """Longest cached prefix of at most `max_tokens` (default len - 1) tokens, in pages.

        Does not lock: call `lock(result.node)` before anything can evict.
        """

    def match_usable(
        self,
        token_ids: Sequence[int],
        namespace: str | None = None,
        max_tokens: int | None = None,
    ) -> MatchResult:
        """`match_prefix` cut to what a request can resume from: with a sliding page space,
        the longest match whose last window has its sliding K/V (swa_radix_cache.py)."""
        return self.match_prefix(token_ids, namespace, max_tokens)

    @abstractmethod
    def insert(
        self,
        token_ids: Sequence[int],
        pages: Sequence[int],
        namespace: str | None = None,
        priority: int = 0,
    ) -> int:
        """Caches the whole pages of `token_ids`; returns how many tokens were already cached.

        `pages[i]` holds tokens [i*page_size, (i+1)*page_size). With n the whole-page length
        and k the return value, the cache takes ownership of pages for [k, n); the caller
        keeps (and frees where duplicate) pages for [0, k) and for tokens beyond n.
        `priority`: the inserting request's; eviction takes lower priorities first.
        """

    @abstractmethod
    def lock(self, node: object) -> None:
        """Protects the path from `node` to its root from eviction (reference counted)."""

    @abstractmethod
    def unlock(self, node: object) -> None:
        """Undoes one `lock(node)`; raises RuntimeError if the node is not locked."""

    @abstractmethod
    def pin(self, node: object) -> None:
        """Keeps the path from `node` to its root out of eviction (reference counted), like
        a lock, but held by a retention pin (cache/retention.py) rather than a request."""

    @abstractmethod
    def unpin(self, node: object) -> None:
        """Undoes one `pin(node)`."""

    def num_pinned_pages(self) -> int:
        """Pages some pin keeps (locked ones included)."""
        return 0

    def load_back(self, match: MatchResult, ensure_free: Callable[[int], bool]) -> MatchResult:
        """Copies a match's tier-only pages (`host_tokens`) into the pool, as far as pages can
        be had (`ensure_free(n)` frees n; False if it cannot); returns the longer match. The
        caller holds `match.node` locked and then moves its lock to the result's node."""
        return match

    def tier_stats(self) -> dict[str, int]:
        """Counters of a second tier (sizes, bytes moved each way) or of the sliding page
        space (swa_radix_cache.py); none without one."""
        return {}

    def close(self) -> None:
        """Saves what must survive a restart (a persistent tier) and releases files."""
        return None

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Frees unlocked, unpinned pages, lowest priority then least recently used first,
        until `num_pages` are freed; returns count."""

    @abstractmethod
    def size_info(self) -> CacheSizeInfo:
        """Evictable, protected and total pages held by the cache."""

    @abstractmethod
    def num_evictable_pages(self) -> int:
        """Pages `evict` could free right now (O(1))."""

    def tree_summary(self, top_k: int = 10, namespaces: Iterable | None = None) -> TreeSummary:
        """Size and shape of the cached tree, its `top_k` largest top-level subtrees (of
        `namespaces` only, when given)."""
        return summarize_tree(self.roots(), top_k, namespaces)

    def tree_outline(self, max_nodes: int = 200, max_children: int = 8) -> dict:
        """The cached tree as a bounded nested outline, largest subtrees first (dashboard)."""
        return tree_outline(self.roots(), max_nodes, max_children)

    def roots(self) -> list:
        """The roots of the cached tree, one per namespace; none without a tree."""
        return []

    @abstractmethod
    def check_integrity(self, held_pages: Iterable[int] = ()) -> None:
        """Raises CacheIntegrityError unless the cache and page accounting are consistent."""

    @abstractmethod
    def reset(self) -> None:
        """Frees every cached page and empties the cache; raises RuntimeError if locked."""


class NoPrefixCache(PrefixCache):
    """Caches nothing (`--disable-radix-cache`): inserted pages are freed at once."""

    shares_prefixes = False

    def __init__(self, allocator: PageAllocator, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._root = object()

    def match_prefix(
        self,
        token_ids: Sequence[int],
        namespace: str | None = None,
        max_tokens: int | None = None,
    ) -> MatchResult:
        return MatchResult(pages=[], num_tokens=0, node=self._root)

    def insert(
        self,
        token_ids: Sequence[int],
        pages: Sequence[int],
        namespace: str | None = None,
        priority: int = 0,
    ) -> int:
        num_pages = len(token_ids) // self.page_size
        check_enough_pages(pages, num_pages)
        self.allocator.free([int(p) for p in pages[:num_pages]])
        return 0

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def pin(self, node: object) -> None:
        pass

    def unpin(self, node: object) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    def size_info(self) -> CacheSizeInfo:
        return CacheSizeInfo(evictable_pages=0, protected_pages=0, total_pages=0)

    def num_evictable_pages(self) -> int:
        return 0

    def check_integrity(self, held_pages: Iterable[int] = ()) -> None:
        check_page_accounting(self.allocator, [], held_pages)

    def reset(self) -> None:
        pass


def check_enough_pages(pages: Sequence[int], num_pages: int) -> None:
    """Raises ValueError when fewer than `num_pages` pages were given for an insert."""
    if len(pages) < num_pages:
        raise ValueError(f"insert needs {num_pages} pages for its tokens; got {len(pages)}")


def check_page_accounting(
    allocator: PageAllocator, tree_pages: Iterable[int], held_pages: Iterable[int]
) -> None:
    """Raises CacheIntegrityError unless each page is exactly one of free, tree, held."""
    owners = {
        "free": allocator.free_pages().tolist(),
        "tree": [int(p) for p in tree_pages],
        "held": [int(p) for p in held_pages],
    }
    everything = [p for pages in owners.values() for p in pages]
    _check_page_range(everything, allocator.num_pages)
    counts = torch.bincount(torch.tensor(everything, dtype=torch.int64), minlength=1)
    counts = torch.nn.functional.pad(counts, (0, allocator.num_pages - counts.numel()))
    leaked = torch.nonzero(counts[RESERVED_PAGES:] == 0).flatten() + RESERVED_PAGES
    shared = torch.nonzero(counts > 1).flatten()
    if leaked.numel() or shared.numel():
        raise CacheIntegrityError(_accounting_message(leaked.tolist(), shared.tolist(), owners))
    if isinstance(allocator, HybridPageAllocator):
        check_sliding_accounting(allocator)


def check_sliding_accounting(allocator: HybridPageAllocator) -> None:
    """Raises CacheIntegrityError unless each sliding page is exactly one of free or the
    sliding K/V of one page in use (held by a request or the tree: checked above)."""
    table = allocator.sliding_page
    used = torch.nonzero(table).flatten()
    if bool(allocator.is_free_mask()[used].any()):
        raise CacheIntegrityError("a free page still has a sliding page")
    sliding = allocator.sliding
    everything = torch.cat([table[used], sliding.free_pages()])
    _check_page_range(everything.tolist(), sliding.num_pages)
    counts = torch.bincount(everything, minlength=sliding.num_pages)[RESERVED_PAGES:]
    if bool((counts != 1).any()):
        leaked = (torch.nonzero(counts == 0).flatten() + RESERVED_PAGES).tolist()
        shared = (torch.nonzero(counts > 1).flatten() + RESERVED_PAGES).tolist()
        raise CacheIntegrityError(
            f"sliding page accounting broken: {len(leaked)} leaked (neither free nor any "
            f"page's) {leaked[:10]}; several owners: {shared[:10]}"
        )


def _check_page_range(pages: list[int], num_pages: int) -> None:
    bad = [p for p in pages if not RESERVED_PAGES <= p < num_pages]
    if bad:
        raise CacheIntegrityError(
            f"page ids {bad[:10]} are outside the pool's range [{RESERVED_PAGES}, {num_pages})"
        )


def _accounting_message(leaked: list[int], shared: list[int], owners: dict) -> str:
    """Says which pages leaked and which have more than one owner (and who those are)."""
    parts = []
    if leaked:
        parts.append(f"{len(leaked)} leaked pages (not free, in the tree, or held): {leaked[:10]}")
    for page in shared[:10]:
        who = [f"{name} x{pages.count(page)}" for name, pages in owners.items() if page in pages]
        parts.append(f"page {page} has several owners: {', '.join(who)}")
    return "page accounting broken: " + "; ".join(parts)
