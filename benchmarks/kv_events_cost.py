"""What KV events cost the core thread: radix-cache insert + evict with events off, with the
sink only (hashing + event structs, emitted into a list), and with the ZMQ publisher's
non-blocking `publish` (its thread batches and sends over inproc, no subscriber).

Inserts `--branches` distinct branches of `--branch-pages` pages (page size 16) under a
shared 4-page prefix, then evicts them all; prints microseconds per page and writes JSON.

Run:  OMP_NUM_THREADS=1 python benchmarks/kv_events_cost.py [--branches 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from radixserve.cache.kv_events import KVEventSink
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import KVEventsConfig
from radixserve.engine.kv_publisher import KVEventPublisher

PAGE_SIZE = 16
PREFIX_PAGES = 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--branches", type=int, default=2000)
    p.add_argument("--branch-pages", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench_results/kv_events_cost.json")
    return p.parse_args()


def fill_and_evict(events: KVEventSink | None, branches: int, branch_pages: int) -> float:
    """Seconds to insert every branch, then evict the whole tree."""
    num_pages = PREFIX_PAGES + branches * branch_pages
    headroom = PREFIX_PAGES + branch_pages + 1  # each insert allocates its prefix pages too
    cache = RadixCache(PageAllocator(num_pages + headroom), PAGE_SIZE, events)
    prefix = list(range(PREFIX_PAGES * PAGE_SIZE))
    start = time.perf_counter()
    for i in range(branches):
        tokens = prefix + [100_000 + i] * (branch_pages * PAGE_SIZE)
        pages = cache.allocator.allocate(len(tokens) // PAGE_SIZE).tolist()
        present = cache.insert(tokens, pages)
        cache.allocator.free(pages[: present // PAGE_SIZE])
    cache.evict(num_pages)
    return time.perf_counter() - start


def interleaved_us_per_page(cases: dict, args: argparse.Namespace) -> dict[str, float]:
    """Median microseconds per page of each case, the cases taking turns in every repeat so
    that a busy machine's drift hits them alike."""
    num_pages = PREFIX_PAGES + args.branches * args.branch_pages
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, make_sink in cases.items():
            times[name].append(fill_and_evict(make_sink(), args.branches, args.branch_pages))
    return {name: 1e6 * statistics.median(t) / num_pages for name, t in times.items()}


def main() -> None:
    args = parse_args()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-events-cost")
    publisher = KVEventPublisher(config)
    cases = {
        "events off": lambda: None,
        "sink only (hash + structs)": lambda: KVEventSink(PAGE_SIZE, "CPU", [].append),
        "sink + ZMQ publisher": lambda: KVEventSink(PAGE_SIZE, "CPU", publisher.publish),
    }
    try:
        medians = interleaved_us_per_page(cases, args)
    finally:
        publisher.close()
    rows = [{"what": name, "us_per_page": us} for name, us in medians.items()]
    print(f"| {'insert + evict':<28} | {'us / page':>9} |\n|{'-' * 30}|{'-' * 11}|")
    for row in rows:
        print(f"| {row['what']:<28} | {row['us_per_page']:9.2f} |")
    print(f"publisher: {publisher.num_batches} batches, {publisher.num_dropped} events dropped")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
