"""What one `/dashboard/stats` poll costs: the tree walk on the core and the JSON build.

Builds radix trees of N nodes (a shared prefix, then N branches of `--branch-pages` pages
each, page size 16), times `PrefixCache.tree_outline` on each, and times `DashboardStats.build` with
its latency windows full (4096 samples each); prints a table and writes JSON. The tree walk
runs on the core's thread between steps, at most once per TREE_REFRESH_S.

Run:  OMP_NUM_THREADS=1 python benchmarks/dashboard_cost.py [--nodes 1000,10000,50000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.server.dashboard_stats import DashboardStats
from radixserve.server.metrics import ServerMetrics

PAGE_SIZE = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1000,10000,50000")
    p.add_argument("--branch-pages", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench_results/dashboard_cost.json")
    return p.parse_args()


def build_tree(num_branches: int, branch_pages: int) -> RadixCache:
    """A 4-page shared prefix, then `num_branches` distinct branches under it."""
    cache = RadixCache(PageAllocator(2 * (4 + num_branches * branch_pages)), PAGE_SIZE)
    prefix = list(range(4 * PAGE_SIZE))
    for i in range(num_branches):
        tokens = prefix + [100_000 + i] * (branch_pages * PAGE_SIZE)
        pages = cache.allocator.allocate(len(tokens) // PAGE_SIZE).tolist()
        present = cache.insert(tokens, pages)
        cache.allocator.free(pages[: present // PAGE_SIZE])
    return cache


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def stats_build_ms(repeats: int) -> float:
    metrics = ServerMetrics()
    for window in metrics.recent.values():
        for i in range(4096):
            window.observe(i / 1000)
    keys = ("num_running_reqs", "num_waiting_reqs", "num_requests", "pool_capacity_pages",
            "pool_free_pages", "tree_pages", "tree_evictable_pages", "tree_protected_pages",
            "page_size", "cache_hit_rate", "prompt_tokens", "cached_tokens",
            "prefill_tokens_computed", "decode_tokens", "retractions", "evicted_pages",
            "spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens",
            "spec_accept_length")  # fmt: skip
    stats = dict.fromkeys(keys, 1)
    board = DashboardStats()
    return median_ms(lambda: board.build(stats, metrics, spec_on=True), repeats)


def main() -> None:
    args = parse_args()
    rows = []
    for num in (int(n) for n in args.nodes.split(",")):
        cache = build_tree(num, args.branch_pages)
        ms = median_ms(lambda c=cache: c.tree_outline(), args.repeats)
        rows.append({"what": f"tree_outline, {num + 1} nodes", "ms": ms})
    rows.append({"what": "DashboardStats.build, full windows", "ms": stats_build_ms(args.repeats)})
    print(f"| {'what':<40} | {'median ms':>9} |\n|{'-' * 42}|{'-' * 11}|")
    for row in rows:
        print(f"| {row['what']:<40} | {row['ms']:9.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
