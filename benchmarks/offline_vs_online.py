"""Offline batch vs online-style concurrency on one shared-prefix workload, in one run.

The same prompts (shared_prefix_offline.py's workload: G groups x P prompts sharing an
S-token system prompt) go through `radixserve.Engine` three ways, each on a fresh cache:
- offline: `Engine.generate` with all prompts at once (what a user of the offline API does);
- online-c<N>: `Engine.async_generate` per prompt with at most N in flight (what `bench
  serve --max-concurrency N` does to a server, without the HTTP hop);
- offline-mrr<N>: all at once with `max_running_requests=N`.
Variants alternate over `--repeats` rounds so that load on a shared machine hits them alike.
Prints wall seconds, forward steps and output tok/s per variant; writes JSON.

Run:  OMP_NUM_THREADS=1 python benchmarks/offline_vs_online.py [--groups 4 --system 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shared_prefix_offline import make_prompts  # noqa: E402

from radixserve import Engine  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="prompts per group")
    p.add_argument("--system", type=int, default=512, help="shared prefix tokens")
    p.add_argument("--question", type=int, default=64, help="question tokens")
    p.add_argument("--output", type=int, default=32, help="output tokens")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="rounds over all variants")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engine-args", default="{}", help="JSON of extra Engine arguments")
    p.add_argument("--out", type=Path, default=Path("bench_results/offline_vs_online.json"))
    return p.parse_args(argv)


def params(args: argparse.Namespace) -> dict:
    return {"temperature": 0, "max_new_tokens": args.output, "ignore_eos": True}


def run_offline(engine: Engine, prompts: list[list[int]], args) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=params(args), progress_bar=False)
    return [o["output_ids"] for o in outs]


def run_online(engine: Engine, prompts: list[list[int]], args) -> list[list[int]]:
    async def main() -> list[list[int]]:
        slots = asyncio.Semaphore(args.concurrency)

        async def one(ids: list[int]) -> list[int]:
            async with slots:
                out = await engine.async_generate(input_ids=ids, sampling_params=params(args))
                return out["output_ids"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(main())


def timed(engine: Engine, run, prompts, args) -> dict:
    engine.flush_cache()
    steps_before = engine.get_stats()["forward_steps"]
    start = time.perf_counter()
    outputs = run(engine, prompts, args)
    wall = time.perf_counter() - start
    steps = engine.get_stats()["forward_steps"] - steps_before
    return {"wall_s": wall, "forward_steps": steps, "outputs": outputs}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args)
    extra = json.loads(args.engine_args)
    c = args.concurrency
    engines = {
        "offline": (Engine(args.model, page_size=args.page_size, **extra), run_offline),
        f"online-c{c}": (Engine(args.model, page_size=args.page_size, **extra), run_online),
        f"offline-mrr{c}": (
            Engine(args.model, page_size=args.page_size, max_running_requests=c, **extra),
            run_offline,
        ),
    }
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, (engine, run) in engines.items():
            runs[name].append(timed(engine, run, prompts, args))
    for engine, _ in engines.values():
        engine.shutdown()
    reference = runs["offline"][0]["outputs"]
    rows = []
    num_out = len(prompts) * args.output
    print(f"{len(prompts)} prompts, {args.system}-token shared prefix, {args.output} out each")
    print(f"{'variant':16}{'wall s':>10}{'steps':>8}{'out tok/s':>11}  same outputs")
    for name, results in runs.items():
        wall = statistics.median(r["wall_s"] for r in results)
        steps = results[0]["forward_steps"]
        same = all(r["outputs"] == reference for r in results)
        rows.append({"variant": name, "wall_s": wall, "forward_steps": steps, "same": same})
        print(f"{name:16}{wall:>10.1f}{steps:>8}{num_out / wall:>11.1f}  {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
