"""TreeNode: one run of whole pages in the radix tree, and the questions asked of one node.

A node's pages live in the KV pool (`pages`), in the hierarchical cache's tier (`host_slots`),
or both; a plain RadixCache uses `pages` only. Locks (running requests) and pins (retention)
count along the path to the root: a node with either is never evicted.
"""

from __future__ import annotations

from collections.abc import Iterator


class TreeNode:
    """A run of whole pages: `key` tokens whose KV lives in `pages`."""

    __slots__ = (
        "key",
        "pages",
        "parent",
        "children",
        "lock_count",
        "pin_count",
        "priority",
        "hit_count",
        "last_access",
        "evicted",
        "host_slots",
        "block_hashes",
    )

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: TreeNode | None):
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_count = 0  # running requests below (or at) this node
        self.pin_count = 0  # retention pins below (or at) this node: see cache/retention.py
        self.priority = 0  # highest priority of the requests that inserted or hit it
        self.hit_count = 0  # admitted requests whose cached prefix covered this node
        self.last_access = 0
        self.evicted = False
        self.host_slots: list[int] | None = None  # second-tier copy (hiradix_cache.py)
        self.block_hashes: list[int] | None = None  # one per page, only with KV events on

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
    """The root of one namespace's tree: no key, no pages; weakly referable (see
    namespace_roots.py)."""

    __slots__ = ("namespace", "__weakref__")

    def __init__(self, namespace: str | None):
        super().__init__((), [], None)
        self.namespace = namespace


# ---- eviction order (both caches) ----


def raise_priority(node: TreeNode, priority: int) -> None:
    """Raises the priority of `node` and its ancestors to at least `priority` (SGLang
    propagates a max along the path, so a shared prefix is as precious as its best user)."""
    for n in node.path_to_root():
        n.priority = max(n.priority, priority)


def is_evictable(node: TreeNode) -> bool:
    """Neither a running request nor a retention pin holds it: a second tier would read the
    same test to demote a pinned node instead of keeping it in the pool."""
    return node.lock_count == 0 and node.pin_count == 0


def evict_key(node: TreeNode) -> tuple[int, int, int, TreeNode]:
    """Eviction order: lowest priority first, least recently used among equals."""
    return (node.priority, node.last_access, id(node), node)


# ---- where a node's pages live (the hierarchical cache) ----


def deepest_in_pool(node: TreeNode) -> TreeNode:
    """`node` or its nearest ancestor with pool pages (a root if none has)."""
    while node.parent is not None and not node.pages:
        node = node.parent
    return node


def tier_path(node: TreeNode, top: TreeNode) -> list[TreeNode]:
    """The nodes from `node` up to, not including, its ancestor `top` (bottom up)."""
    path = []
    while node is not top and node.parent is not None:
        path.append(node)
        node = node.parent
    return path


def depth(node: TreeNode) -> int:
    """Tokens from the root to the end of `node`."""
    return sum(len(n.key) for n in node.path_to_root())


def num_tier_only(node: TreeNode) -> int:
    """Pages of `node` held by the tier alone (0 when it is in the pool or not in the tier)."""
    return len(node.host_slots) if node.host_slots is not None and not node.pages else 0


def has_pool_child(node: TreeNode) -> bool:
    return any(child.pages for child in node.children.values())


def is_tier_evictable(node: TreeNode) -> bool:
    """A tier-only node no load in progress holds (locks cover a path being loaded)."""
    return node.parent is not None and not node.pages and node.lock_count == 0
