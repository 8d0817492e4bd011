"""paged_decode alone: ms per call of the C++ decode attention kernel, no model around it.

One query per request over `context` cached positions, SmolLM2-135M's attention shape by
default (9 query heads over 3 KV heads, head_dim 64), random K/V. Pool layouts: page 16 with
each request's pages in order (what a fresh pool hands out), and page 1 with the slots
shuffled (a pool after much eviction); fp32 and bf16 pools. Medians over `--repeats` calls
after one warm-up; the pool stays in cache between calls, unlike inside a decode step
(decode_roofline.py's attn column), so this isolates the kernel's compute.

Run:  OMP_NUM_THREADS=1 python benchmarks/paged_decode_kernel.py [--batches 1,16]
Writes a table to stdout and all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve.native.extension import load_cpu_ops

LAYOUTS = {"page16": (16, False), "page1-shuffled": (1, True)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per case (median)")
    p.add_argument("--out", default="paged_decode_kernel.json")
    return p.parse_args(argv)


def time_case(ops, args, batch: int, context: int, layout: str, dtype: torch.dtype) -> float:
    """Median ms of one paged_decode call for this case."""
    page_size, shuffle = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    pages_per_req = -(-context // page_size)
    num_pages = batch * pages_per_req
    kv_shape = (num_pages * page_size, args.kv_heads, args.head_dim)
    k = torch.randn(kv_shape, generator=gen).to(dtype)
    v = torch.randn(kv_shape, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen) if shuffle else torch.arange(num_pages)
    table = order.reshape(batch, pages_per_req).contiguous()  # [batch, pages_per_req]
    q = torch.randn(batch, args.heads, args.head_dim, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.long)
    scale = args.head_dim**-0.5
    ops.paged_decode(q, k, v, table, lens, page_size, -1, scale, 0, None)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ops.paged_decode(q, k, v, table, lens, page_size, -1, scale, 0, None)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    rows = []
    print(f"{'batch':>6} {'context':>8} {'layout':>15} {'kv dtype':>9} {'ms':>8}")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            for layout in LAYOUTS:
                for name, dtype in DTYPES.items():
                    ms = time_case(ops, args, batch, context, layout, dtype)
                    rows.append(
                        dict(batch=batch, context=context, layout=layout, kv_dtype=name, ms=ms)
                    )
                    print(f"{batch:>6} {context:>8} {layout:>15} {name:>9} {ms:>8.3f}")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
