"""What attention soft-capping (attn_logit_softcapping) costs in the C++ CPU kernels: process
CPU ms per call of paged_decode and paged_extend with logit_cap 0 (plain) and 50, rounds
alternating A/B so that load on a shared machine falls on both alike.

Gemma-3-4B's attention shape by default (8 query heads over 4 KV heads of 256), fp32 pool,
pages of 16 in order, random K/V; decode: `--batch` queries over `--context` positions;
extend: `--new` tokens of one request over `--context` cached ones.

Run:  OMP_NUM_THREADS=1 python benchmarks/softcap_attention.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.native.extension import load_cpu_ops
from radixserve.native.machine import describe_cpu

CAP = 50.0  # Gemma 2's attn_logit_softcapping


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--rounds", type=int, default=9, help="A/B rounds (median)")
    return p.parse_args(argv)


def calls(ops, args) -> dict[str, object]:
    """name -> function(cap) running one kernel call of that case."""
    gen = torch.Generator().manual_seed(0)
    pages = -(-(args.context + args.new) // 16)
    kv_shape = (args.batch * pages * 16, args.kv_heads, args.head_dim)
    k, v = torch.randn(kv_shape, generator=gen), torch.randn(kv_shape, generator=gen)
    table = torch.arange(args.batch * pages).reshape(args.batch, pages).contiguous()
    scale = args.head_dim**-0.5
    q_dec = torch.randn(args.batch, args.heads, args.head_dim, generator=gen)
    lens = torch.full((args.batch,), args.context, dtype=torch.long)
    q_ext = torch.randn(args.new, args.heads, args.head_dim, generator=gen)
    zero, one = torch.tensor([0]), torch.tensor([args.new])

    def decode(cap: float) -> None:
        ops.paged_decode(q_dec, k, v, table, lens, 16, -1, scale, 0, None, cap)

    def extend(cap: float) -> None:
        prefix = torch.tensor([args.context])
        ops.paged_extend(q_ext, k, v, table, zero, prefix, one, zero, 16, -1, scale, None, cap)

    return {"paged_decode": decode, "paged_extend": extend}


def cpu_ms(run, cap: float) -> float:
    start = time.process_time()
    run(cap)
    return (time.process_time() - start) * 1e3


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    ops = load_cpu_ops()
    print(f"CPU: {describe_cpu()}; torch threads 1; process CPU ms per call, median")
    print("| kernel | logit_cap 0 | logit_cap 50 | ratio |\n|---|---|---|---|")
    for name, run in calls(ops, args).items():
        run(0.0), run(CAP)  # warm-up
        plain, capped = [], []
        for _ in range(args.rounds):
            plain.append(cpu_ms(run, 0.0))
            capped.append(cpu_ms(run, CAP))
        a, b = statistics.median(plain), statistics.median(capped)
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
