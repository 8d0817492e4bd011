"""Summaries of a radix tree, read-only, for people: `summarize_tree` (`GET /cache/tree`: size,
shape, the largest top-level subtrees with their tokens, hits and pins) and `tree_outline`
(the dashboard's drawing: a bounded nested outline, largest subtrees first).

    (all namespaces)          own / subtree tokens   in the outline every node reports its own
      ├── "You are a helpful…"   96 / 512          tokens, its subtree's tokens, its hit count
      │     ├── "Question: 1…"   64 / 64           and its first token ids; children are kept
      │     └── … 3 smaller children, 352 tokens   largest first, at most `max_children` of
      └── "Translate…"           32 / 32           them, the rest counted (`num_hidden`, ...)

A node's hit count is the number of admitted requests whose cached prefix covered it
(`RadixCache.record_hit`), so a subtree's hits are its top node's. Token ids stay ids: the
caller decodes them. Under a host tier (HiRadixCache) a node may hold no pool pages, only tier
slots: its tokens count as cached (a hit loads them back) and also as `host_only`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

PREVIEW_TOKENS = 8  # token ids shown per subtree or outline node: enough to tell prompts apart


@dataclass(frozen=True)
class SubtreeSummary:
    namespace: str | None
    first_token_ids: list[int]  # the subtree's first tokens, a preview
    num_tokens: int  # tokens cached in the subtree (pool or host tier)
    num_host_only_tokens: int  # of those, tokens only in the host tier (no pool pages)
    num_nodes: int
    hit_count: int  # admitted requests whose cached prefix covered its top node
    max_depth: int  # deepest node below it, in nodes
    pinned: bool  # some retention pin holds part of it
    locked: bool  # some running request holds part of it


@dataclass(frozen=True)
class TreeSummary:
    num_nodes: int  # roots excluded
    num_namespaces: int  # namespaces with cached pages (the default one included)
    max_depth: int  # nodes on the longest root-to-leaf path
    num_tokens: int  # pool or host tier
    num_host_only_tokens: int  # only in the host tier
    largest_subtrees: list[SubtreeSummary]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_tree(
    roots: Iterable, top_k: int = 10, namespaces: Iterable | None = None
) -> TreeSummary:
    """Walks every node once; `roots` are RadixCache roots (nodes with `children`, `key`,
    `hit_count`, `pin_count`, `lock_count`). The counts cover every namespace; the largest
    subtrees come from `namespaces` only, when given (a tenant sees its own prompts only)."""
    roots = list(roots)
    shown = None if namespaces is None else set(namespaces)
    subtrees = [
        _summarize_subtree(child, root.namespace)
        for root in roots
        for child in root.children.values()
    ]
    subtrees.sort(key=lambda s: s.num_tokens, reverse=True)
    largest = [s for s in subtrees if shown is None or s.namespace in shown][:top_k]
    return TreeSummary(
        num_nodes=sum(s.num_nodes for s in subtrees),
        num_namespaces=sum(1 for root in roots if root.children),
        max_depth=max((s.max_depth for s in subtrees), default=0),
        num_tokens=sum(s.num_tokens for s in subtrees),
        num_host_only_tokens=sum(s.num_host_only_tokens for s in subtrees),
        largest_subtrees=largest,
    )


def _summarize_subtree(top, namespace: str | None) -> SubtreeSummary:
    num_tokens = num_host_only = num_nodes = max_depth = 0
    stack = [(top, 1)]
    while stack:
        node, depth = stack.pop()
        num_tokens += len(node.key)
        if not node.pages:
            num_host_only += len(node.key)
        num_nodes += 1
        max_depth = max(max_depth, depth)
        stack.extend((child, depth + 1) for child in node.children.values())
    return SubtreeSummary(
        namespace=namespace,
        first_token_ids=list(top.key[:PREVIEW_TOKENS]),
        num_tokens=num_tokens,
        num_host_only_tokens=num_host_only,
        num_nodes=num_nodes,
        hit_count=top.hit_count,
        max_depth=max_depth,
        pinned=top.pin_count > 0,
        locked=top.lock_count > 0,
    )


def tree_outline(roots: Iterable, max_nodes: int = 200, max_children: int = 8) -> dict[str, Any]:
    """The tree as nested dicts `{tokens, subtree_tokens, hits, locked, pinned, host_only,
    first_ids, children, num_hidden, hidden_tokens}` under one root that stands for every namespace.
    One pass over the nodes (sizes from the leaves up), then a top-down pick bounded by
    `max_nodes`."""
    if max_nodes < 1 or max_children < 1:
        raise ValueError(
            f"max_nodes and max_children must be >= 1; got {max_nodes}, {max_children}"
        )
    roots = list(roots)
    sizes = _subtree_tokens(roots)
    top = [c for r in roots for c in r.children.values()]
    summary = {"tokens": 0, "subtree_tokens": sum(sizes[c] for c in top), "hits": 0,
               "locked": False, "pinned": False, "host_only": False,
               "first_ids": []}  # fmt: skip
    return _add_children(summary, top, sizes, max_children, [max_nodes])


def _subtree_tokens(roots: list[Any]) -> dict[Any, int]:
    """Each node's tokens plus its descendants', from the leaves up."""
    order = list(_depth_first(roots))
    sizes: dict[Any, int] = {}
    for node in reversed(order):  # children come after their parent in `order`
        size = len(node.key)
        for child in node.children.values():  # a plain loop: ~2x faster than sum(genexpr)
            size += sizes[child]
        sizes[node] = size
    return sizes


def _depth_first(roots: list[Any]) -> Iterator[Any]:
    stack = list(roots)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _add_children(
    entry: dict[str, Any],
    children: list[Any],
    sizes: dict[Any, int],
    max_children: int,
    budget: list[int],
) -> dict[str, Any]:
    """Fills `entry` with its largest children while the node budget lasts; the children
    left out are counted, not lost."""
    shown = heapq.nlargest(min(max_children, max(budget[0], 0)), children, key=sizes.__getitem__)
    budget[0] -= len(shown)
    entry["children"] = [
        _add_children(_entry(c, sizes), list(c.children.values()), sizes, max_children, budget)
        for c in shown
    ]
    entry["num_hidden"] = len(children) - len(shown)
    entry["hidden_tokens"] = sum(sizes[c] for c in children) - sum(sizes[c] for c in shown)
    return entry


def _entry(node: Any, sizes: dict[Any, int]) -> dict[str, Any]:
    return {
        "tokens": len(node.key),
        "subtree_tokens": sizes[node],
        "hits": node.hit_count,
        "locked": node.lock_count > 0,
        "pinned": node.pin_count > 0,
        "host_only": not node.pages,  # its KV is only in the host tier
        "first_ids": list(node.key[:PREVIEW_TOKENS]),
    }
