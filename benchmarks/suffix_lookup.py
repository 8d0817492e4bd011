"""What one SUFFIX lookup costs (the request's own sequence + the store of outputs), by the
number of tokens stored, on synthetic outputs: `agent` (one 110-token plan with a few tokens
changed per output, as repeated agent tasks write) and `zipf` (token ids drawn from a Zipf
law, s = 1.3: a few tokens very frequent, the worst case for occurrence counting).

Run:  python benchmarks/suffix_lookup.py [--sizes 10000,100000,1000000] [--out PATH]
Prints a table (median and max ms per lookup) and writes it to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from radixserve.engine.speculative.suffix import SuffixStore
from radixserve.engine.speculative.suffix_match import SuffixLimits, speculate
from radixserve.native.machine import describe_cpu

LIMITS = SuffixLimits(max_tree_depth=24, max_spec_factor=1.0, min_token_prob=0.1, max_spec_tokens=8)
VOCAB = 49152


def agent_output(rng: np.random.Generator, plan: np.ndarray) -> np.ndarray:
    out = plan.copy()
    out[rng.integers(0, len(out), size=4)] = rng.integers(0, VOCAB, size=4)
    return out


def zipf_output(rng: np.random.Generator, plan: np.ndarray) -> np.ndarray:
    return rng.zipf(1.3, len(plan)) % VOCAB


def measure(kind: str, size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    plan = rng.integers(0, VOCAB, size=110)
    make = agent_output if kind == "agent" else zipf_output
    store = SuffixStore(max_requests=10**6, max_tokens=size)
    while store.num_tokens + len(plan) <= size:
        store.add(None, make(rng, plan).tolist())
    prompt, out = rng.integers(0, VOCAB, size=300), make(rng, plan)
    store.speculate(None, out[:24], LIMITS)  # joins the store's outputs once
    times = []
    for pos in range(1, len(out)):
        own = np.concatenate([prompt, out[:pos]])
        start = time.perf_counter()
        speculate(own, len(own) - 1, own[-24:], LIMITS)
        store.speculate(None, own[-24:], LIMITS)
        times.append(time.perf_counter() - start)
    ms = np.array(times) * 1e3
    return {
        "kind": kind,
        "tokens": size,
        "median_ms": float(np.median(ms)),
        "max_ms": float(ms.max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--out", default="bench_results/suffix_lookup.json")
    args = parser.parse_args()
    rows = [measure(kind, int(s)) for kind in ("agent", "zipf") for s in args.sizes.split(",")]
    print(f"CPU: {describe_cpu()}")
    print(f"{'outputs':>8} {'tokens':>8} {'median ms':>9} {'max ms':>7}")
    for r in rows:
        print(f"{r['kind']:>8} {r['tokens']:8d} {r['median_ms']:9.2f} {r['max_ms']:7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": describe_cpu(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
