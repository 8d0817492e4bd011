"""What `/dashboard/stats` answers: the core's counters, rates over the last minute, latency
percentiles and the radix tree's summary, as one JSON object.

Cheap by construction: one `get_stats` call to the core per poll, the tree summary at most
every `TREE_REFRESH_S` whoever polls, and windows of bounded size (server/sliding_window.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from radixserve.server.metrics import ServerMetrics
from radixserve.server.sliding_window import WINDOW_S, CounterWindow

TREE_REFRESH_S = 2.0
"""The tree walk costs time on the core (every node once): viewers share one per period."""
WINDOWED_COUNTERS = (
    "prompt_tokens", "cached_tokens", "prefill_tokens_computed", "decode_tokens",
    "retractions", "evicted_pages", "num_requests",
)  # fmt: skip


class DashboardStats:
    """Builds the dashboard's JSON from core stats; keeps the counter window and last tree."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self.counters = CounterWindow(clock=clock)
        self._tree: dict[str, Any] | None = None
        self._tree_at = -TREE_REFRESH_S

    def tree_is_stale(self) -> bool:
        return self._tree is None or self.clock() - self._tree_at >= TREE_REFRESH_S

    def set_tree(self, tree: dict[str, Any]) -> None:
        self._tree, self._tree_at = tree, self.clock()

    def build(self, stats: dict[str, Any], metrics: ServerMetrics, spec_on: bool) -> dict:
        """The JSON body; `stats` is the core's `get_stats`, `spec_on` whether the server was
        started with a speculative algorithm."""
        self.counters.record({key: stats[key] for key in WINDOWED_COUNTERS})
        window = self.counters.growth()
        return {
            "uptime_s": self.clock() - self.started,
            "requests": {
                "running": stats["num_running_reqs"],
                "waiting": stats["num_waiting_reqs"],
                "total": stats["num_requests"],
            },
            "kv_pages": kv_pages(stats),
            "cache": cache_section(stats, window),
            "throughput": throughput(window),
            "latency": {"window_s": WINDOW_S}
            | {name: w.percentiles().as_dict() for name, w in metrics.recent.items()},
            "pressure": pressure(stats, window),
            "speculative": speculative(stats) if spec_on or stats["spec_verify_steps"] else None,
            "tree": self._tree,
        }


def kv_pages(stats: dict[str, Any]) -> dict[str, int]:
    """The pool split five ways; free + tree_evictable + tree_locked + tree_pinned + held ==
    capacity (a page both locked and pinned counts as locked)."""
    capacity, free, tree = (
        stats["pool_capacity_pages"],
        stats["pool_free_pages"],
        stats["tree_pages"],
    )
    return {
        "page_size": stats["page_size"],
        "capacity": capacity,
        "free": free,
        "tree_evictable": stats["tree_evictable_pages"],
        "tree_locked": stats["tree_protected_pages"],  # shared by running requests
        "tree_pinned": tree - stats["tree_evictable_pages"] - stats["tree_protected_pages"],
        "held": capacity - free - tree,  # running requests' own pages, not (yet) in the tree
    }


def cache_section(stats: dict[str, Any], window) -> dict[str, Any]:
    last = None
    if window is not None and window[1]["prompt_tokens"] > 0:
        last = window[1]["cached_tokens"] / window[1]["prompt_tokens"]
    return {
        "hit_rate_since_start": stats["cache_hit_rate"],
        "hit_rate_last_minute": last,
        "prompt_tokens": stats["prompt_tokens"],
        "cached_tokens": stats["cached_tokens"],
        "prefill_tokens_computed": stats["prefill_tokens_computed"],
    }


def throughput(window) -> dict[str, Any] | None:
    """Tokens per second over the window; None until the dashboard has polled twice."""
    if window is None or window[0] <= 0:
        return None
    seconds, growth = window
    return {
        "window_s": seconds,
        "input_tokens_per_s": growth["prompt_tokens"] / seconds,
        "output_tokens_per_s": growth["decode_tokens"] / seconds,
        "prefill_computed_per_s": growth["prefill_tokens_computed"] / seconds,
        "cached_tokens_per_s": growth["cached_tokens"] / seconds,
        "requests_per_s": growth["num_requests"] / seconds,
    }


def pressure(stats: dict[str, Any], window) -> dict[str, Any]:
    growth = window[1] if window is not None else {}
    return {
        "retractions": stats["retractions"],
        "evicted_pages": stats["evicted_pages"],
        "retractions_last_minute": growth.get("retractions"),
        "evicted_pages_last_minute": growth.get("evicted_pages"),
    }


def speculative(stats: dict[str, Any]) -> dict[str, Any]:
    drafts = stats["spec_draft_tokens"]
    return {
        "draft_tokens": drafts,
        "accepted_tokens": stats["spec_accepted_tokens"],
        "acceptance_rate": stats["spec_accepted_tokens"] / drafts if drafts else None,
        "accept_length": stats["spec_accept_length"],
    }


def label_tree(tree: dict[str, Any], decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """Adds a `label` (the first words of each node's tokens) to every node, in place."""
    tree["label"] = decode(tree["first_ids"]) if tree["first_ids"] else ""
    for child in tree["children"]:
        label_tree(child, decode)
    return tree
