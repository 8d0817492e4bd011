"""RadixCache: a radix tree of cached KV pages keyed by token ids, at page granularity.

Every node's key is a whole number of pages; children are keyed by their first page's tokens,
so a walk compares whole pages (tuple slices), never single tokens. Each namespace (e.g. a
cache salt) has its own root, so requests of different namespaces never share a node.

    root ── (a b | c d) ──┬── (e f)           keys of page_size 2; `|` marks page edges
                          └── (g h | i j)     matching "a b c d g h x y" splits the last
                                              node into (g h) -> (i j) and returns (g h)

Namespace roots live in one of two maps, so that a salt per user never piles up roots:

    _roots        default root + every namespace root with pages under it   (held strongly)
    _empty_roots  namespace roots without pages: handed out by match_prefix  (held weakly)
                  for a namespace seen first, or emptied by eviction

An empty root lives exactly as long as a match result or a request refers to it; while one
does, match_prefix and insert hand out that same object (dfs-weight groups its requests under
it), and the first insert with pages moves it to `_roots`. Eviction works from the `_leaves`
set and moves a root between the maps in O(1) (a root knows its namespace): its cost never
depends on the number of namespaces.
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import (
    CacheIntegrityError,
    CacheSizeInfo,
    MatchResult,
    NoPrefixCache,
    PrefixCache,
    check_enough_pages,
    check_page_accounting,
)


class TreeNode:
    """A run of whole pages: `key` tokens whose KV lives in `pages`."""

    __slots__ = (
        "key",
        "pages",
        "parent",
        "children",
        "lock_count",
        "last_access",
        "evicted",
        "hit_count",
    )

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: TreeNode | None):
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_count = 0
        self.last_access = 0
        self.evicted = False
        self.hit_count = 0  # admitted requests whose cached prefix covered this node

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.evicted

    def path_to_root(self) -> Iterator[TreeNode]:
        """This node and its ancestors, roots excluded."""
        node = self
        while node.parent is not None:
            yield node
            node = node.parent


class RootNode(TreeNode):
    """The root of one namespace's tree: no key, no pages; weakly referable (see above)."""

    __slots__ = ("namespace", "__weakref__")

    def __init__(self, namespace: str | None):
        super().__init__((), [], None)
        self.namespace = namespace


class RadixCache(PrefixCache):
    """Prefix cache over a radix tree; LRU eviction of unlocked leaves."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._clear()

    def parent_of(self, node: object) -> TreeNode | None:
        return node.parent if isinstance(node, TreeNode) else None

    def reset(self) -> None:
        if self._num_protected:
            raise RuntimeError("cannot reset the radix cache while some nodes are locked")
        nodes = list(self._nodes())
        self.allocator.free([page for node in nodes for page in node.pages])
        for node in [*nodes, *self._empty_roots.values()]:
            node.evicted = True  # stale handles must not be locked again
        self._clear()

    def _clear(self) -> None:
        self._roots: dict[str | None, RootNode] = {None: RootNode(None)}
        self._empty_roots: weakref.WeakValueDictionary[str, RootNode] = (
            weakref.WeakValueDictionary()
        )
        self._leaves: set[TreeNode] = set()  # childless non-root nodes: eviction candidates
        self._num_evictable = 0
        self._num_protected = 0
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
        root = self._root(namespace)
        if limit == 0 or not root.children:
            return MatchResult(pages=[], num_tokens=0, node=root)
        key = token_ids if isinstance(token_ids, tuple) else tuple(token_ids[:limit])
        node, num_tokens = self._walk(root, key, limit)
        return MatchResult(pages=self._path_pages(node), num_tokens=num_tokens, node=node)

    def insert(
        self, token_ids: Sequence[int], pages: Sequence[int], namespace: str | None = None
    ) -> int:
        num_pages = len(token_ids) // self.page_size
        check_enough_pages(pages, num_pages)
        key = tuple(token_ids[: num_pages * self.page_size])
        root = self._root(namespace)
        node, num_cached = self._walk(root, key)
        if num_cached < len(key):
            new_pages = [int(p) for p in pages[num_cached // self.page_size : num_pages]]
            self._keep_root(root)
            self._add_leaf(node, key[num_cached:], new_pages)
        return num_cached

    def _root(self, namespace: str | None) -> RootNode:
        """The namespace's live root; a new empty one (held weakly) if it has none."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._empty_roots.get(namespace)
        if root is None:
            root = self._empty_roots[namespace] = RootNode(namespace)
        return root

    def _keep_root(self, root: RootNode) -> None:
        """Holds a root strongly: it is getting pages."""
        self._roots[root.namespace] = root
        self._empty_roots.pop(root.namespace, None)

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
        upper.lock_count = node.lock_count
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        node.parent.children[node.key[: self.page_size]] = upper
        node.key, node.pages, node.parent = node.key[num_tokens:], node.pages[num_pages:], upper
        upper.children[node.key[: self.page_size]] = node
        return upper

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int]) -> None:
        leaf = TreeNode(key, pages, parent)
        leaf.last_access = self._clock
        parent.children[key[: self.page_size]] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._num_evictable += len(pages)

    def _path_pages(self, node: TreeNode) -> list[int]:
        runs = [n.pages for n in node.path_to_root()]
        return list(chain.from_iterable(reversed(runs)))

    def roots(self) -> list[RootNode]:
        """The roots of every namespace with pages in the tree (the default one first)."""
        return list(self._roots.values())

    def record_hit(self, node: object) -> None:
        node = self._live_node(node)
        for n in node.path_to_root():
            n.hit_count += 1

    # ---- lock / unlock ----

    def lock(self, node: object) -> None:
        node = self._live_node(node)
        for n in node.path_to_root():
            if n.lock_count == 0:
                self._num_evictable -= len(n.pages)
                self._num_protected += len(n.pages)
            n.lock_count += 1

    def unlock(self, node: object) -> None:
        node = self._live_node(node)
        if node.lock_count == 0 and not node.is_root:
            raise RuntimeError("unlock of a radix cache node that is not locked")
        for n in node.path_to_root():
            n.lock_count -= 1
            if n.lock_count == 0:
                self._num_protected -= len(n.pages)
                self._num_evictable += len(n.pages)

    def _live_node(self, node: object) -> TreeNode:
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a RadixCache node handle; got {type(node).__name__}")
        if node.evicted:
            raise RuntimeError("node was evicted; lock it right after match_prefix")
        return node

    # ---- evict ----

    def evict(self, num_pages: int) -> int:
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            freed += self._detach_leaf(leaf)
            parent = leaf.parent
            if not parent.is_root and not parent.children and parent.lock_count == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.allocator.free(freed)
        return len(freed)

    def _evictable_leaves(self) -> Iterator[TreeNode]:
        return (leaf for leaf in self._leaves if leaf.lock_count == 0)

    def _detach_leaf(self, leaf: TreeNode) -> list[int]:
        """Takes an unlocked leaf out of the tree; returns its pages, for the caller to free."""
        self._num_evictable -= len(leaf.pages)
        del leaf.parent.children[leaf.key[: self.page_size]]
        leaf.evicted = True
        self._leaves.discard(leaf)
        if not leaf.parent.children and not leaf.parent.is_root:
            self._leaves.add(leaf.parent)
        if isinstance(leaf.parent, RootNode):
            self._release_empty_root(leaf.parent)
        return leaf.pages

    def _release_empty_root(self, root: RootNode) -> None:
        """Holds a namespace root whose tree became empty weakly (the default one stays)."""
        if not root.children and root.namespace is not None:
            del self._roots[root.namespace]
            self._empty_roots[root.namespace] = root

    # ---- sizes and checks ----

    def size_info(self) -> CacheSizeInfo:
        return CacheSizeInfo(
            evictable_pages=self._num_evictable,
            protected_pages=self._num_protected,
            total_pages=self._num_evictable + self._num_protected,
        )

    def num_evictable_pages(self) -> int:
        return self._num_evictable

    def check_integrity(self, held_pages: Iterable[int] = ()) -> None:
        for node in self._nodes():
            self._check_node(node)
        self._check_roots()
        self._check_counters()
        check_page_accounting(self.allocator, self._tree_pages(), held_pages)

    def _check_node(self, node: TreeNode) -> None:
        size = self.page_size
        if not node.is_root and (not node.key or len(node.key) % size):
            raise CacheIntegrityError(f"node key of {len(node.key)} tokens is not whole pages")
        if len(node.pages) * size != len(node.key):
            raise CacheIntegrityError(
                f"node has {len(node.pages)} pages for {len(node.key)} tokens (page_size {size})"
            )
        for first_page, child in node.children.items():
            if child.parent is not node or child.key[:size] != first_page or child.evicted:
                raise CacheIntegrityError("a child is filed under the wrong key or parent")
        children_locks = sum(child.lock_count for child in node.children.values())
        if not node.is_root and node.lock_count < children_locks:
            raise CacheIntegrityError(
                f"node lock count {node.lock_count} is below its children's sum {children_locks}"
            )

    def _check_roots(self) -> None:
        for namespace, root in self._roots.items():
            if root.namespace != namespace or not root.is_root:
                raise CacheIntegrityError(f"the root of namespace {namespace!r} is misfiled")
            if namespace is not None and not root.children:
                raise CacheIntegrityError(f"namespace {namespace!r} keeps an empty root")
        for namespace, root in self._empty_roots.items():
            if root.children or namespace in self._roots or root.namespace != namespace:
                raise CacheIntegrityError(f"namespace {namespace!r} has a stale empty root")

    def _check_counters(self) -> None:
        nodes = list(self._nodes())
        evictable = sum(len(n.pages) for n in nodes if n.lock_count == 0)
        protected = sum(len(n.pages) for n in nodes if n.lock_count > 0)
        if (evictable, protected) != (self._num_evictable, self._num_protected):
            raise CacheIntegrityError(
                f"counters say {self._num_evictable} evictable / {self._num_protected} protected "
                f"pages; the tree holds {evictable} / {protected}"
            )
        if any(n.lock_count < 0 for n in nodes):
            raise CacheIntegrityError("a node has a negative lock count")
        if self._leaves != {n for n in nodes if not n.children and not n.is_root}:
            raise CacheIntegrityError("the set of leaves disagrees with the tree")

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node of every namespace, roots included (depth first)."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _tree_pages(self) -> Iterator[int]:
        for node in self._nodes():
            yield from node.pages


def create_prefix_cache(disable: bool, allocator: PageAllocator, page_size: int) -> PrefixCache:
    """A RadixCache, or a NoPrefixCache when the radix cache is disabled."""
    cls = NoPrefixCache if disable else RadixCache
    return cls(allocator, page_size)
