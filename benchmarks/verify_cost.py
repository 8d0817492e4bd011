"""What a verify step of K drafts costs over a plain decode step (the ratio the adaptive
speculation policy's cost model rests on): one request at context --context, the
default model (or --model), forwards of 1 + K rows with logits at every row (as a verify
computes them) against forwards of 1 row, in thread CPU time (one torch thread: steadier
than wall time on a shared machine) and wall time.

Run:  OMP_NUM_THREADS=1 python benchmarks/verify_cost.py [--model PATH] [--context 256]
      [--drafts 1,2,4,8] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.runner import ModelRunner
from radixserve.model.source import default_model_path
from radixserve.native.machine import describe_cpu


def _timed(runner: ModelRunner, prompt: list[int], pages, num_new: int, repeats: int):
    """Median (thread CPU s, wall s) of a forward of `num_new` rows after `prompt`."""
    size = runner.pool.page_size
    tokens = [7] * num_new
    rows = list(range(num_new)) if num_new > 1 else ()
    cpu, wall = [], []
    for _ in range(repeats):
        batch = ForwardBatch.build([tokens], [len(prompt)], [pages], size, verify_indices=rows)
        start_cpu, start = time.thread_time(), time.perf_counter()
        runner.forward(batch)
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--drafts", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or str(default_model_path())
    runner = ModelRunner.create(LoadConfig(model=model), CacheConfig(max_total_tokens=4096))
    size = runner.pool.page_size
    prompt = [(i * 31) % 1000 + 10 for i in range(args.context)]
    drafts = [int(k) for k in args.drafts.split(",")]
    pages = runner.pool.extend_page_table([], args.context + max(drafts) + 1)
    with torch.inference_mode():
        runner.forward(ForwardBatch.build([prompt], [0], [pages], size))
        for _ in range(3):  # warm-up
            _timed(runner, prompt, pages, 1 + max(drafts), 1)
        base_cpu, base_wall = _timed(runner, prompt, pages, 1, args.repeats)
        print(f"{describe_cpu()}; {model}; context {args.context}, {args.threads} thread(s)")
        print(f"decode (1 row): {base_cpu * 1e3:.2f} ms CPU, {base_wall * 1e3:.2f} ms wall")
        print("| K drafts | rows | ms CPU | x decode (CPU) | x decode (wall) |")
        print("|---|---|---|---|---|")
        for k in drafts:
            cpu, wall = _timed(runner, prompt, pages, 1 + k, args.repeats)
            print(f"| {k} | {k + 1} | {cpu * 1e3:.2f} | {cpu / base_cpu:.2f} | "
                  f"{wall / base_wall:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
