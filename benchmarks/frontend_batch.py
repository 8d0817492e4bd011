"""Agent programs: `run_batch` on the radix cache vs the same calls one at a time, cache off.

Runs the `few_shot_qa` and `react_tools` example programs over `--num` inputs, both ways,
side by side in one run; prints wall time, cache hit rate and speedup, and writes JSON.

Run:  python benchmarks/frontend_batch.py [--num 64 --max-tokens 12 --programs few_shot_qa]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import radixserve as sgl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "agents"))

PROGRAMS = {"few_shot_qa": "few_shot_qa", "react_tools": "react"}  # module -> program name


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num", type=int, default=64, help="inputs per program")
    p.add_argument("--max-tokens", type=int, default=12, help="cap on every gen")
    p.add_argument("--programs", default="few_shot_qa,react_tools")
    p.add_argument("--out", default="bench_results/frontend_batch.json")
    return p.parse_args()


def run(module_name: str, num: int, max_tokens: int, batched: bool) -> dict:
    """Wall time and hit rate of `num` programs, via run_batch (radix) or one by one (none)."""
    module = importlib.import_module(module_name)
    program = getattr(module, PROGRAMS[module_name])
    inputs = [{"question": module.QUESTIONS[i % len(module.QUESTIONS)]} for i in range(num)]
    engine = sgl.Engine(max_total_tokens=16384, disable_radix_cache=not batched)
    sgl.set_default_backend(engine)
    options = {"max_new_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    if batched:
        program.run_batch(inputs, **options)
    else:
        for kwargs in inputs:
            program.run(**kwargs, **options)
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    engine.shutdown()
    return {"wall_s": wall, "cache_hit_rate": stats["cache_hit_rate"],
            "prefill_tokens_computed": stats["prefill_tokens_computed"]}  # fmt: skip


def main() -> None:
    args = parse_args()
    rows = []
    for name in args.programs.split(","):
        batched = run(name, args.num, args.max_tokens, batched=True)
        serial = run(name, args.num, args.max_tokens, batched=False)
        rows.append({"program": name, "radix_run_batch": batched, "none_one_by_one": serial,
                     "speedup": serial["wall_s"] / batched["wall_s"]})  # fmt: skip
    print(
        f"{'program':12} {'batch+radix s':>14} {'hit rate':>9} {'serial+none s':>14} {'speedup':>8}"
    )
    for r in rows:
        b, s = r["radix_run_batch"], r["none_one_by_one"]
        print(f"{r['program']:12} {b['wall_s']:14.1f} {b['cache_hit_rate']:9.3f} "
              f"{s['wall_s']:14.1f} {r['speedup']:7.2f}x")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
