"""The theoretical maximum prefix-cache hit rate of a sequence of prompts.

An unbounded, page-granular cache that keeps everything: each prompt can hit the longest
page-aligned prefix (at most len - 1 tokens, as the last prompt token must be computed for
its logits) already inserted by an earlier request. A finished request inserts its prompt
and its answer but the answer's last token, whose KV no engine computes.
"""

from __future__ import annotations

from collections.abc import Sequence


class PageTrie:
    """Page-aligned token prefixes; node ids are keyed by (parent node id, page of tokens)."""

    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; got {page_size}")
        self.page_size = page_size
        self.nodes: dict[tuple[int, tuple[int, ...]], int] = {}

    def _pages(self, ids: Sequence[int], limit: int):
        for start in range(0, limit // self.page_size * self.page_size, self.page_size):
            yield tuple(ids[start : start + self.page_size])

    def match(self, ids: Sequence[int], limit: int | None = None) -> int:
        """Tokens of `ids[:limit]` present, whole pages only."""
        node, num_tokens = 0, 0
        for page in self._pages(ids, len(ids) if limit is None else min(limit, len(ids))):
            node = self.nodes.get((node, page), -1)
            if node < 0:
                break
            num_tokens += self.page_size
        return num_tokens

    def insert(self, ids: Sequence[int]) -> None:
        """Adds every whole-page prefix of `ids`."""
        node = 0
        for page in self._pages(ids, len(ids)):
            node = self.nodes.setdefault((node, page), len(self.nodes) + 1)


def max_hit_tokens(
    prompts: Sequence[Sequence[int]],
    page_size: int,
    outputs: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Per prompt, the tokens an ideal cache holds from earlier requests (in list order)."""
    trie = PageTrie(page_size)
    hits = []
    for i, prompt in enumerate(prompts):
        hits.append(trie.match(prompt, len(prompt) - 1))
        answer = list(outputs[i][:-1]) if outputs is not None else []
        trie.insert(list(prompt) + answer)
    return hits


def max_hit_rate(
    prompts: Sequence[Sequence[int]],
    page_size: int,
    outputs: Sequence[Sequence[int]] | None = None,
) -> float:
    """Best possible cached / total prompt tokens; `outputs` (if given) are cached too."""
    total = sum(len(p) for p in prompts)
    return sum(max_hit_tokens(prompts, page_size, outputs)) / total if total else 0.0
