"""Scoring (SGLang's /v1/score, `Engine.score`): a judge prompt over many candidates, in one run.

An agent judging or classifying candidates asks, for each of N items after one long shared
query (instructions, a rubric, few-shot examples), how likely each of a few label tokens is
to come next. Three ways to compute the same numbers on the same weights (the default model's
GGUF unless --model), in one process, taking turns:

- `radixserve`: `Engine.score` (one request per item; admission's in-batch dedupe computes the
  shared query once, the tree keeps it for the next batch),
- `radixserve-no-cache`: the same with `disable_radix_cache` (every item computes the query),
- `transformers`: one left-padded batch of query + item through the model, the last
  position's log-softmax at the labels (what a transformers user writes; the query is
  computed once per item).

Each round draws a fresh query (cold) and scores two batches of fresh items after it: the
first call (`cold`) and the second (`warm`: the same judge prompt over other candidates).
Reported: items/s (median over rounds) per system and call, and the largest difference of a
label's log-probability between radixserve and transformers (the same weights: the kernels'
rounding only).

Run:  OMP_NUM_THREADS=2 python benchmarks/scoring.py [--items 32] [--query-len 512]
      [--item-len 8] [--rounds 3] [--model path/to/file.gguf] [--out bench_results/scoring.json]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch

from radixserve import Engine
from radixserve.native.machine import describe_cpu
from radixserve_bench.hf_batcher import load_hf_model
from radixserve_bench.report import save_report

VOCAB_LOW, VOCAB_HIGH = 200, 40000
LABELS = [9230, 2838, 330]
"""Three label tokens of SmolLM2's vocabulary (" Yes", " No", " A"); any ids in the vocabulary."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="any GGUF or HF folder (default: SmolLM2)")
    p.add_argument("--items", type=int, default=32)
    p.add_argument("--query-len", type=int, default=512)
    p.add_argument("--item-len", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/scoring.json")
    return p.parse_args(argv)


@torch.inference_mode()
def hf_scores(hf, query: list[int], items: list[list[int]]) -> list[list[float]]:
    """Each item's label probabilities from one left-padded batch of query + item."""
    prompts = [query + item for item in items]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    logits = hf.model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
    return torch.log_softmax(logits, -1)[:, LABELS].exp().tolist()


def engine_scorer(engine: Engine):
    return lambda query, items: engine.score(query=query, items=items, label_token_ids=LABELS)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    engines = {
        "radixserve": Engine(args.model),
        "radixserve-no-cache": Engine(args.model, disable_radix_cache=True),
    }
    hf = load_hf_model(args.model, dtype="float32")
    systems = {name: engine_scorer(engine) for name, engine in engines.items()}
    systems["transformers"] = lambda query, items: hf_scores(hf, query, items)
    times: dict[tuple[str, str], list[float]] = {}
    worst = 0.0
    try:
        for _ in range(args.rounds):
            for name, score in systems.items():
                query = ids(args.query_len)  # a fresh judge prompt per system and round
                for call in ("cold", "warm"):
                    items = [ids(args.item_len) for _ in range(args.items)]
                    start = time.perf_counter()
                    score(query, items)
                    times.setdefault((name, call), []).append(time.perf_counter() - start)
            query, items = ids(args.query_len), [ids(args.item_len) for _ in range(args.items)]
            ours, theirs = systems["radixserve"](query, items), hf_scores(hf, query, items)
            gaps = [
                abs(math.log(a) - math.log(b)) for r, s in zip(ours, theirs) for a, b in zip(r, s)
            ]
            worst = max(worst, *gaps)
    finally:
        for engine in engines.values():
            engine.shutdown()
    rows = [{"system": name, "call": call, "items_per_s": args.items / statistics.median(t)}
            for (name, call), t in times.items()]  # fmt: skip
    report = {"cpu": describe_cpu(), "args": vars(args), "rows": rows, "max_logprob_diff": worst}
    print_report(report)
    save_report(report, args.out)
    return report


def print_report(report: dict) -> None:
    print(f"CPU: {report['cpu']}")
    by_key = {(r["system"], r["call"]): r["items_per_s"] for r in report["rows"]}
    print("| system | cold items/s | warm items/s | warm vs transformers |")
    print("|---|---|---|---|")
    peer = by_key[("transformers", "warm")]
    for name in dict.fromkeys(r["system"] for r in report["rows"]):
        cold, warm = by_key[(name, "cold")], by_key[(name, "warm")]
        print(f"| {name} | {cold:.1f} | {warm:.1f} | {warm / peer:.2f}x |")
    worst = report["max_logprob_diff"]
    print(f"largest log-probability difference, radixserve vs transformers: {worst:.2e}")


if __name__ == "__main__":
    main()
