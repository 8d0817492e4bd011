"""The cost of --enable-deterministic-inference's attention on CPU, default model, side by side.

Three cases, taking turns in each of `--rounds` rounds (noise hits all alike):
- off: the flag off (decode kernel for decodes, SDPA for fresh prefills);
- flag, old attention: the flag on (batch-invariant linear layers) with cpu_fused's default
  routing, i.e. the cost of the linear layers alone;
- flag: the flag as shipped, every query through paged_extend.
Per case: prefill tokens/s (one prompt of `--prefill-len`), decode step ms at batch 1 and
`--batch` after `--context-len` tokens (forward_micro.py's method: median of timed steps).

Run:  OMP_NUM_THREADS=1 python benchmarks/deterministic_attention.py --threads 1
Writes a table to stdout and all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from forward_micro import random_prompts, rs_decode, rs_prefill  # noqa: E402

from radixserve.config import CacheConfig, LoadConfig  # noqa: E402
from radixserve.model.runner import ModelRunner  # noqa: E402

CASES = ("off", "flag, old attention", "flag")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2 GGUF)")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the timed prefill")
    p.add_argument("--context-len", type=int, default=512, help="tokens before decode")
    p.add_argument("--batch", type=int, default=8, help="batch of the batched decode row")
    p.add_argument("--steps", type=int, default=6, help="timed decode steps (median)")
    p.add_argument("--repeats", type=int, default=2, help="timed prefill runs (median)")
    p.add_argument("--rounds", type=int, default=2, help="turns of the three cases")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("bench_results/deterministic_attention.json"))
    return p.parse_args(argv)


def make_runner(args: argparse.Namespace, deterministic: bool) -> ModelRunner:
    load = LoadConfig(model=args.model, device="cpu", enable_deterministic_inference=deterministic)
    tokens = max(args.batch * (args.context_len + args.steps + 16), args.prefill_len + 16)
    return ModelRunner.create(load, CacheConfig(max_total_tokens=tokens))


def measure(args: argparse.Namespace, runner: ModelRunner) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    prefill = rs_prefill(runner, random_prompts(gen, 1, args.prefill_len, vocab), args.repeats)
    row = {"prefill_tok_s": args.prefill_len / prefill}
    for batch in (1, args.batch):
        prompts = random_prompts(gen, batch, args.context_len, vocab)
        steps = random_prompts(gen, args.steps + 1, batch, vocab)
        row[f"decode_bs{batch}_ms"] = 1000 * rs_decode(runner, prompts, steps)
    return row


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    off, on = make_runner(args, False), make_runner(args, True)
    runs: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            runner = off if case == "off" else on
            runner.attn.deterministic = case == "flag"
            runs[case].append(measure(args, runner))
    keys = list(runs[CASES[0]][0])
    table = {c: {k: statistics.median(r[k] for r in runs[c]) for k in keys} for c in CASES}
    print(f"threads={torch.get_num_threads()} attention={type(on.attn).__name__}")
    print(f"{'case':>22}" + "".join(f"{k:>16}" for k in keys))
    for case, row in table.items():
        print(f"{case:>22}" + "".join(f"{row[k]:>16.1f}" for k in keys))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    data = {"threads": torch.get_num_threads(), "args": settings, "median": table, "runs": runs}
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    main()
