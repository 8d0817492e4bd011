"""Embeddings served beside llama.cpp's own server, in one run: speed, and agreement.

radixserve (`serve --is-embedding`) and `llama-server --embeddings --pooling last` serve the
same GGUF (the default model's Q4_1 unless --model) through OpenAI's /v1/embeddings. Both get
the same token ids (so tokenizers and BOS rules cannot differ) in two workloads:

- `documents`: distinct passages (RAG indexing: no shared prefix),
- `instructed`: one long task instruction before short distinct queries (how agents and
  Qwen3-Embedding-style models embed queries: "Instruct: ...\\nQuery: ..."); the instruction
  repeats on every request.

Each workload runs at concurrency 1 and `--concurrency` (one input per request, a fresh
random set per system and round, so no system gets another's inputs warm), rounds taking
turns. Reported: inputs/s and prompt tokens/s (medians), and the cosine between the two
systems' embeddings of one more set of inputs, the same for both (the same weights and
pooling: ~1 up to the kernels' rounding; the cross-check of radixserve's pooling against
llama.cpp's).

Run:  OMP_NUM_THREADS=2 python benchmarks/embeddings.py [--inputs 64] [--rounds 3]
      [--concurrency 8] [--doc-len 256] [--instruction-len 384] [--query-len 24]
      [--model path/to/file.gguf] [--out bench_results/embeddings.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from radixserve.native.machine import describe_cpu
from radixserve_bench.report import save_report
from radixserve_bench.systems import LaunchOptions, SystemSpec, launch, unavailable_reason

SYSTEMS = (
    SystemSpec("radixserve", "radixserve", "openai", ("--is-embedding",), "auto"),
    SystemSpec("llama-server", "llama-server", "openai", (), "gguf-shipped"),
)
LLAMA_EMBEDDING_FLAGS = "--embeddings --pooling last -b 4096 -ub 4096"
"""llama-server as its users serve embeddings with a decoder model: last-token pooling (its
default normalization, L2), a physical batch that holds a whole prompt (it must)."""
VOCAB_LOW, VOCAB_HIGH = 200, 40000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="any GGUF (default: SmolLM2-135M-Instruct)")
    p.add_argument("--inputs", type=int, default=64, help="inputs per workload, level, round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=256)
    p.add_argument("--instruction-len", type=int, default=384)
    p.add_argument("--query-len", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/embeddings.json")
    return p.parse_args(argv)


def workload_inputs(name: str, args, rng: random.Random) -> list[list[int]]:
    """The token ids of one round's inputs: fresh random ids, the instruction kept per run."""

    def ids(n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    if name == "documents":
        return [ids(args.doc_len) for _ in range(args.inputs)]
    return [args.instruction + ids(args.query_len) for _ in range(args.inputs)]


async def embed_all(url: str, inputs: list[list[int]], concurrency: int) -> tuple[float, list]:
    """Seconds to embed every input (one per request, `concurrency` in flight) and the
    embeddings in input order."""
    results: list = [None] * len(inputs)
    queue = list(enumerate(inputs))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def worker() -> None:
            while queue:
                index, ids = queue.pop(0)
                body = {"input": [ids], "encoding_format": "float"}
                async with session.post(url + "/v1/embeddings", json=body) as r:
                    answer = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: {r.status} {answer}")
                results[index] = answer["data"][0]["embedding"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, results


def cosines(a: list, b: list) -> list[float]:
    out = []
    for x, y in zip(a, b):
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        out.append(float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    args.instruction = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.instruction_len)]
    options = LaunchOptions(model=args.model, llama_server_args=LLAMA_EMBEDDING_FLAGS)
    for spec in SYSTEMS:
        if (reason := unavailable_reason(spec, options)) is not None:
            raise SystemExit(f"{spec.name} cannot run here: {reason}")
    levels = sorted({1, args.concurrency})
    max_len = max(args.doc_len, args.instruction_len + args.query_len) + 8
    log_dir = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    servers = {}
    try:
        for spec in SYSTEMS:
            servers[spec.name] = launch(spec, options, max(levels), log_dir, max_len)
        rows, agreement = [], {}
        for workload in ("documents", "instructed"):
            for level in levels:
                times = {name: [] for name in servers}
                tokens = 0
                for _ in range(args.rounds):
                    for name, server in servers.items():
                        fresh = workload_inputs(workload, args, rng)
                        took, _ = asyncio.run(embed_all(server.url, fresh, level))
                        times[name].append(took)
                        tokens = sum(len(ids) for ids in fresh)
                if level == 1:  # agreement: both systems embed the same inputs, once
                    same = workload_inputs(workload, args, rng)
                    answers = [asyncio.run(embed_all(s.url, same, 1))[1] for s in servers.values()]
                    agreement[workload] = cosines(*answers)
                for name, taken in times.items():
                    median = statistics.median(taken)
                    rows.append({"workload": workload, "concurrency": level, "system": name,
                                 "inputs_per_s": args.inputs / median,
                                 "tokens_per_s": tokens / median})  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    report = {
        "cpu": describe_cpu(),
        "args": {k: v for k, v in vars(args).items() if k != "instruction"},
        "rows": rows,
        "cosine_min": {w: min(c) for w, c in agreement.items()},
        "cosine_median": {w: statistics.median(c) for w, c in agreement.items()},
    }
    print_report(report)
    save_report(report, args.out)
    return report


def print_report(report: dict) -> None:
    print(f"CPU: {report['cpu']}")
    print("| workload | concurrency | radixserve inputs/s | llama-server inputs/s | ratio |")
    print("|---|---|---|---|---|")
    by_key = {(r["workload"], r["concurrency"], r["system"]): r for r in report["rows"]}
    for workload, level in sorted({(r["workload"], r["concurrency"]) for r in report["rows"]}):
        ours = by_key[(workload, level, "radixserve")]["inputs_per_s"]
        peer = by_key[(workload, level, "llama-server")]["inputs_per_s"]
        print(f"| {workload} | {level} | {ours:.1f} | {peer:.1f} | {ours / peer:.2f}x |")
    for workload, low in report["cosine_min"].items():
        median = report["cosine_median"][workload]
        print(f"cosine radixserve vs llama-server, {workload}: min {low:.5f}, median {median:.5f}")


if __name__ == "__main__":
    main()
