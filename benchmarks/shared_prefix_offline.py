"""Offline shared-prefix benchmark: radix cache vs no cache, side by side in one run.

G groups x P prompts; each group shares a system prompt of S tokens, each prompt adds a
Q-token question; O greedy output tokens each. Prompts are shuffled (seeded) and sent as one
offline batch through `radixserve.Engine`. Prints wall time, prefill tokens computed, cache
hit rate and the workload's theoretical maximum hit rate, and writes JSON.

Run:  python benchmarks/shared_prefix_offline.py [--groups 8 --prompts 8 --system 1024 ...]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from radixserve import Engine
from radixserve_bench.hit_rate import max_hit_rate

TOKEN_RANGE = (1000, 40000)  # ordinary tokens of the default model's vocabulary


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8, help="prompts per group")
    p.add_argument("--system", type=int, default=1024, help="shared prefix tokens")
    p.add_argument("--question", type=int, default=64, help="question tokens")
    p.add_argument("--output", type=int, default=32, help="output tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/shared_prefix_offline.json")
    return p.parse_args()


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.groups):
        system = [rng.randrange(*TOKEN_RANGE) for _ in range(args.system)]
        for _ in range(args.prompts):
            prompts.append(system + [rng.randrange(*TOKEN_RANGE) for _ in range(args.question)])
    rng.shuffle(prompts)
    return prompts


def run_system(name: str, prompts, args, **engine_args) -> dict:
    engine = Engine(args.model, page_size=args.page_size, **engine_args)
    params = {"temperature": 0, "max_new_tokens": args.output, "ignore_eos": True}
    start = time.perf_counter()
    outputs = engine.generate(input_ids=prompts, sampling_params=params, progress_bar=False)
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    engine.shutdown()
    return {
        "system": name,
        "wall_s": wall,
        "prefill_tokens_computed": stats["prefill_tokens_computed"],
        "prompt_tokens": stats["prompt_tokens"],
        "cached_tokens": stats["cached_tokens"],
        "cache_hit_rate": stats["cache_hit_rate"],
        "output_tokens": sum(len(o["output_ids"]) for o in outputs),
        "output_ids": [o["output_ids"] for o in outputs],
    }


def main() -> None:
    args = parse_args()
    prompts = make_prompts(args)
    optimum = max_hit_rate(prompts, args.page_size)
    rows = [
        run_system("radix", prompts, args),
        run_system("none", prompts, args, disable_radix_cache=True),
    ]
    same = rows[0].pop("output_ids") == rows[1].pop("output_ids")
    print(f"{len(prompts)} prompts, theoretical max hit rate {optimum:.3f}; same outputs: {same}")
    print(f"{'system':8} {'wall s':>8} {'prefill tok':>12} {'hit rate':>9} {'of max':>7}")
    for r in rows:
        of_max = r["cache_hit_rate"] / optimum if optimum else 0.0
        r["hit_rate_of_max"] = of_max
        print(
            f"{r['system']:8} {r['wall_s']:8.1f} {r['prefill_tokens_computed']:12d} "
            f"{r['cache_hit_rate']:9.3f} {of_max:7.3f}"
        )
    speedup = rows[1]["wall_s"] / rows[0]["wall_s"]
    print(f"radix speed-up over none: {speedup:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "args": vars(args),
        "max_hit_rate": optimum,
        "same_outputs": same,
        "speedup": speedup,
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
