"""NamespaceRoots: the root of each namespace's tree, kept so that a salt per user never piles
up roots.

    live   default root + every namespace root with pages under it   (held strongly)
    empty  namespace roots without pages: handed out by `get`       (held weakly)
           for a namespace seen first, or emptied by eviction

An empty root lives exactly as long as a match result or a request refers to it; while one
does, `get` hands out that same object (dfs-weight groups its requests under it), and the
first insert with pages moves it to the live map (`keep`). Eviction moves a root between the
maps in O(1) (`release_if_empty`: a root knows its namespace): its cost never depends on the
number of namespaces.
"""

from __future__ import annotations

import weakref

from radixserve.cache.prefix_cache import CacheIntegrityError
from radixserve.cache.tree_node import RootNode


class NamespaceRoots:
    """The live (strongly held) and empty (weakly held) roots of every namespace."""

    def __init__(self) -> None:
        self._live: dict[str | None, RootNode] = {None: RootNode(None)}
        self._empty: weakref.WeakValueDictionary[str, RootNode] = weakref.WeakValueDictionary()

    def get(self, namespace: str | None) -> RootNode:
        """The namespace's live root; a new empty one (held weakly) if it has none."""
        root = self._live.get(namespace)
        if root is None:
            root = self._empty.get(namespace)
        if root is None:
            root = self._empty[namespace] = RootNode(namespace)
        return root

    def keep(self, root: RootNode) -> None:
        """Holds a root strongly: it is getting pages."""
        self._live[root.namespace] = root
        self._empty.pop(root.namespace, None)

    def release_if_empty(self, root: RootNode) -> None:
        """Holds a namespace root whose tree became empty weakly (the default one stays)."""
        if not root.children and root.namespace is not None:
            del self._live[root.namespace]
            self._empty[root.namespace] = root

    def live(self) -> list[RootNode]:
        """The roots of every namespace with pages in the tree (the default one first)."""
        return list(self._live.values())

    def empty(self) -> list[RootNode]:
        """The roots without pages that something still refers to."""
        return list(self._empty.values())

    def check(self) -> None:
        """Each root is filed under its namespace, in the map its pages select."""
        for namespace, root in self._live.items():
            if root.namespace != namespace or not root.is_root:
                raise CacheIntegrityError(f"the root of namespace {namespace!r} is misfiled")
            if namespace is not None and not root.children:
                raise CacheIntegrityError(f"namespace {namespace!r} keeps an empty root")
        for namespace, root in self._empty.items():
            if root.children or namespace in self._live or root.namespace != namespace:
                raise CacheIntegrityError(f"namespace {namespace!r} has a stale empty root")
