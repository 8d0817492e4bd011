"""A summary of a radix tree for dashboards (`GET /cache/tree`): its size and shape, and its
largest top-level subtrees with their token counts, hits and pins."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

PREVIEW_TOKENS = 8  # token ids shown per subtree: enough to tell prompts apart


@dataclass(frozen=True)
class SubtreeSummary:
    namespace: str | None
    first_token_ids: list[int]  # the subtree's first tokens, a preview
    num_tokens: int  # tokens cached in the subtree
    num_nodes: int
    hit_count: int  # locks taken on its nodes: admissions that read it (a chunked prefill
    # also re-locks its own new pages once per chunk)
    max_depth: int  # deepest node below it, in nodes
    pinned: bool  # some retention pin holds part of it
    locked: bool  # some running request holds part of it


@dataclass(frozen=True)
class TreeSummary:
    num_nodes: int  # roots excluded
    num_namespaces: int  # namespaces with cached pages (the default one included)
    max_depth: int  # nodes on the longest root-to-leaf path
    num_tokens: int
    largest_subtrees: list[SubtreeSummary]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_tree(roots: Iterable, top_k: int = 10) -> TreeSummary:
    """Walks every node once; `roots` are RadixCache roots (nodes with `children`, `key`,
    `hit_count`, `pin_count`, `lock_count`)."""
    roots = list(roots)
    subtrees = [
        _summarize_subtree(child, root.namespace)
        for root in roots
        for child in root.children.values()
    ]
    subtrees.sort(key=lambda s: s.num_tokens, reverse=True)
    return TreeSummary(
        num_nodes=sum(s.num_nodes for s in subtrees),
        num_namespaces=sum(1 for root in roots if root.children),
        max_depth=max((s.max_depth for s in subtrees), default=0),
        num_tokens=sum(s.num_tokens for s in subtrees),
        largest_subtrees=subtrees[:top_k],
    )


def _summarize_subtree(top, namespace: str | None) -> SubtreeSummary:
    num_tokens = num_nodes = hits = max_depth = 0
    stack = [(top, 1)]
    while stack:
        node, depth = stack.pop()
        num_tokens += len(node.key)
        num_nodes += 1
        hits += node.hit_count
        max_depth = max(max_depth, depth)
        stack.extend((child, depth + 1) for child in node.children.values())
    return SubtreeSummary(
        namespace=namespace,
        first_token_ids=list(top.key[:PREVIEW_TOKENS]),
        num_tokens=num_tokens,
        num_nodes=num_nodes,
        hit_count=hits,
        max_depth=max_depth,
        pinned=top.pin_count > 0,
        locked=top.lock_count > 0,
    )
