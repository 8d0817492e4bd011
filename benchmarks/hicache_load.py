"""What the hierarchical cache saves on a real model: time to first token of a long prompt
computed, hit in the pool, loaded back from the host tier, and read from the tier file by a
restarted engine.

One Engine with `--enable-hierarchical-cache --hicache-dir <tmp>` and a pool a few prompts
large. Each repeat: a fresh prompt of `--prompt-tokens` random tokens (cold: computed), the
same prompt again (pool hit), a flood of other prompts that evicts it from the pool, then
the prompt again (loaded back from the tier). After the repeats the engine is closed and
reopened on the same folder, and the first prompt is asked once more (warm restart). Every
request generates one token, so its latency is its TTFT. Prints a table, writes JSON.

Run:  OMP_NUM_THREADS=1 python benchmarks/hicache_load.py [--prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from radixserve import Engine
from radixserve_bench.report import save_report

ONE_TOKEN = {"temperature": 0, "max_new_tokens": 1}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--pool-prompts", type=int, default=3, help="pool size, in prompts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_results/hicache_load.json")
    return p.parse_args()


def timed(engine: Engine, ids: list[int]) -> tuple[float, dict]:
    start = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=ONE_TOKEN)
    return time.perf_counter() - start, out["meta_info"]


def one_repeat(engine: Engine, args: argparse.Namespace, rng: random.Random) -> dict:
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    cold, _ = timed(engine, prompt)
    pool_hit, _ = timed(engine, prompt)
    for _ in range(args.pool_prompts + 1):  # evicts the prompt from the pool
        engine.generate(input_ids=[rng.randrange(1000, 40000) for _ in range(len(prompt))],
                        sampling_params=ONE_TOKEN)  # fmt: skip
    tier_hit, meta = timed(engine, prompt)
    host = (meta.get("cached_tokens_details") or {}).get("host", 0)
    return {"prompt": prompt, "cold": cold, "pool": pool_hit, "tier": tier_hit, "host": host}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    folder = tempfile.mkdtemp(prefix="hicache_")
    flags = {
        "max_total_tokens": args.pool_prompts * (args.prompt_tokens + 16),
        "enable_hierarchical_cache": True,
        "hicache_ratio": 4.0,
        "hicache_dir": folder,
    }
    with Engine(args.model, **flags) as engine:
        timed(engine, [rng.randrange(1000, 40000) for _ in range(64)])  # warm up
        repeats = [one_repeat(engine, args, rng) for _ in range(args.repeats)]
        stats = engine.get_stats()
    start = time.perf_counter()
    with Engine(args.model, **flags) as engine:
        open_s = time.perf_counter() - start
        restart, meta = timed(engine, repeats[0]["prompt"])
    rows = [
        row("computed (cold)", [r["cold"] for r in repeats], 0),
        row("pool hit", [r["pool"] for r in repeats], 0),
        row("loaded back from the tier", [r["tier"] for r in repeats], repeats[-1]["host"]),
        row("warm restart (tier file)", [restart], meta["cached_tokens"]),
    ]
    print(f"{args.prompt_tokens}-token prompt, 1 output token, median of {args.repeats}")
    print(f"{'case':<28} {'TTFT s':>8} {'vs cold':>8} {'from tier':>10}")
    cold = rows[0]["ttft_s"]
    for r in rows:
        speedup = cold / r["ttft_s"]
        print(f"{r['case']:<28} {r['ttft_s']:>8.3f} {speedup:>7.1f}x {r['tier_tokens']:>10}")
    print(f"reopening the engine on the tier file took {open_s:.1f} s (model load included)")
    report = {"args": vars(args), "rows": rows, "open_s": open_s,
              "bytes_to_device": stats["hicache_bytes_to_device"],
              "bytes_to_host": stats["hicache_bytes_to_host"]}  # fmt: skip
    save_report(report, args.out)
    print(f"wrote {args.out}")


def row(case: str, seconds: list[float], tier_tokens: int) -> dict:
    return {"case": case, "ttft_s": statistics.median(seconds), "tier_tokens": tier_tokens}


if __name__ == "__main__":
    main()
