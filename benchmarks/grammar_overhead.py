"""Per-token cost of constrained decoding (xgrammar masks) vs unconstrained, side by side.

Runs the same prompts through one Engine at batch 1 and 32: greedy decoding of exactly
`--tokens` tokens, without a constraint and under a regex that admits any such text.
Reports the median ms per decode step over interleaved repeats and the overhead; prints a
table and writes JSON.

Run:  python benchmarks/grammar_overhead.py [--tokens 48 --batches 1,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from radixserve import Engine

REGEX = r"[A-Za-z ,.'\n]{1,4000}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_results/grammar_overhead.json")
    return p.parse_args()


def time_batch(engine: Engine, batch: int, tokens: int, constrained: bool) -> float:
    """Seconds per decode step for `batch` prompts generating `tokens` tokens each."""
    prompts = [f"Story {i}: Once upon a time in a small village," for i in range(batch)]
    params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    if constrained:
        params["regex"] = REGEX
    engine.generate(prompts, params | {"max_new_tokens": 2}, progress_bar=False)  # warm up
    engine.flush_cache()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, progress_bar=False)
    elapsed = time.perf_counter() - start
    assert all(len(o["output_ids"]) == tokens for o in outputs)
    return elapsed / tokens


def main() -> None:
    args = parse_args()
    engine = Engine(args.model, max_total_tokens=16384)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        plain, masked = [], []
        for _ in range(args.repeats):  # interleaved, so that machine noise hits both alike
            plain.append(time_batch(engine, batch, args.tokens, constrained=False))
            masked.append(time_batch(engine, batch, args.tokens, constrained=True))
        plain, masked = statistics.median(plain), statistics.median(masked)
        rows.append({
            "batch": batch,
            "ms_per_step_unconstrained": plain * 1e3,
            "ms_per_step_constrained": masked * 1e3,
            "overhead_pct": (masked / plain - 1) * 100,
        })  # fmt: skip
    print(f"{'batch':>5} {'plain ms/step':>14} {'regex ms/step':>14} {'overhead':>9}")
    for r in rows:
        print(
            f"{r['batch']:5d} {r['ms_per_step_unconstrained']:14.1f} "
            f"{r['ms_per_step_constrained']:14.1f} {r['overhead_pct']:8.1f}%"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "regex": REGEX, "rows": rows}, indent=2))
    engine.shutdown()


if __name__ == "__main__":
    main()
