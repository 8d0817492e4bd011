"""The cost of --enable-deterministic-inference's attention on CPU, default model, side by side.

Three cases, taking turns in each of `--rounds` rounds (noise hits all alike):
- off: the flag off (decode kernel for decodes, SDPA for fresh prefills);
- flag, old attention: the flag on (batch-invariant linear layers) with cpu_fused's default
  routing, i.e. the cost of the linear layers alone;
- flag: the flag as shipped, every query through paged_extend.
Per case: prefill tokens/s (one prompt of `--prefill-len`), decode step ms at batch 1 and
`--batch` after `--context-len` tokens (forward_micro.py's method: median of timed steps).
Then attention alone (`--attention-only` skips the rest): one layer's backend call, default
routing vs deterministic, in ms (min of `--attn-repeats`), the model's head shapes.

Run:  OMP_NUM_THREADS=1 python benchmarks/deterministic_attention.py --threads 1
(from a worktree: PYTHONPATH=. so that its radixserve, not the installed one, is measured)
Writes a table to stdout and all numbers to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from forward_micro import allocate, random_prompts, release, rs_decode, rs_prefill  # noqa: E402

from radixserve.config import CacheConfig, LoadConfig  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.runner import ModelRunner  # noqa: E402

CASES = ("off", "flag, old attention", "flag")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2 GGUF)")
    p.add_argument("--quantization", default="auto", help="auto (the GGUF's blocks) | none (fp32)")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the timed prefill")
    p.add_argument("--context-len", type=int, default=512, help="tokens before decode")
    p.add_argument("--batch", type=int, default=8, help="batch of the batched decode row")
    p.add_argument("--steps", type=int, default=6, help="timed decode steps (median)")
    p.add_argument("--repeats", type=int, default=2, help="timed prefill runs (median)")
    p.add_argument("--rounds", type=int, default=2, help="turns of the three cases")
    p.add_argument("--attn-repeats", type=int, default=50, help="timed attention calls (min)")
    p.add_argument("--attention-only", action="store_true", help="only the attention table")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("bench_results/deterministic_attention.json"))
    return p.parse_args(argv)


def make_runner(args: argparse.Namespace, deterministic: bool) -> ModelRunner:
    load = LoadConfig(
        model=args.model,
        device="cpu",
        quantization=args.quantization,
        enable_deterministic_inference=deterministic,
    )
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


# (name, requests, context tokens before the new ones, new tokens per request)
ATTENTION_CASES = [
    ("decode bs1 ctx 512", 1, 512, 1),
    ("decode bs1 ctx 2032", 1, 2032, 1),
    ("decode bs8 ctx 512", 8, 512, 1),
    ("verify 5 over 512", 1, 512, 5),
    ("prefill 512", 1, 0, 512),
]


def time_attention(args: argparse.Namespace, runner: ModelRunner, case: tuple) -> dict:
    """One layer's attention call for `case`, default routing vs deterministic, min ms."""
    _, reqs, prefix, new = case
    tables = allocate(runner, reqs, prefix + new)
    try:
        ps = runner.pool.page_size
        batch = ForwardBatch.build([[1] * new] * reqs, [prefix] * reqs, tables, ps)
        heads, kv_heads = runner.config.num_heads, runner.pool.shape.num_kv_heads
        dim = runner.pool.shape.head_dim
        q, k, v = (torch.randn(reqs * new, h, dim) for h in (heads, kv_heads, kv_heads))
        best = {"default_ms": float("inf"), "deterministic_ms": float("inf")}
        for _ in range(2):  # two turns each, alternating
            for key in best:
                runner.attn.deterministic = key == "deterministic_ms"
                runner.attn.init_forward(batch)
                for _ in range(args.attn_repeats):
                    start = time.perf_counter()
                    runner.attn.forward(q, k, v, 0, batch)
                    best[key] = min(best[key], 1000 * (time.perf_counter() - start))
        return best
    finally:
        release(runner, tables)


def attention_table(args: argparse.Namespace, runner: ModelRunner) -> dict[str, dict]:
    table = {case[0]: time_attention(args, runner, case) for case in ATTENTION_CASES}
    print(f"{'attention, one layer':>22}{'default ms':>16}{'deterministic ms':>18}")
    for name, row in table.items():
        print(f"{name:>22}{row['default_ms']:>16.3f}{row['deterministic_ms']:>18.3f}")
    return table


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    on = make_runner(args, True)
    if not getattr(on.attn, "deterministic", False):
        sys.exit(f"{type(on.attn).__name__} has no deterministic mode (this radixserve, or no C++)")
    print(f"threads={torch.get_num_threads()} attention={type(on.attn).__name__}")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    data = {"threads": torch.get_num_threads(), "args": settings}
    data["attention"] = attention_table(args, on)
    if not args.attention_only:
        data["median"], data["runs"] = forward_table(args, make_runner(args, False), on)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return data


def forward_table(args: argparse.Namespace, off: ModelRunner, on: ModelRunner) -> tuple:
    """Whole forwards, the three cases taking turns; (medians per case, every run)."""
    runs: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            runner = off if case == "off" else on
            runner.attn.deterministic = case == "flag"
            runs[case].append(measure(args, runner))
    keys = list(runs[CASES[0]][0])
    table = {c: {k: statistics.median(r[k] for r in runs[c]) for k in keys} for c in CASES}
    print(f"{'case':>22}" + "".join(f"{k:>16}" for k in keys))
    for case, row in table.items():
        print(f"{case:>22}" + "".join(f"{row[k]:>16.1f}" for k in keys))
    return table, runs


if __name__ == "__main__":
    main()
