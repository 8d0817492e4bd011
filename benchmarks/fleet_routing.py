"""Fleet routing: sglang-router's cache_aware vs round_robin in front of N radixserve workers.

N `radixserve serve` workers start once (each pinned to its own core, one torch thread,
loopback only); for each workload and policy their caches are flushed, a router with that
policy is started in front, the workload runs closed-loop (CONCURRENCY requests in flight, a
turn sent once its parent answered) and the router is stopped. A "single" run sends the same
workload to worker 0 alone: the hit rate one instance that sees every prefix reaches (its KV
pool is one worker's, which these workloads do not fill). A last run kills a worker halfway
through a cache_aware run and counts the requests lost, once with the router's default
failover settings and once (killing another) with FAILOVER_ROUTER_ARGS.

The router routes by request text (its approximate radix tree holds characters), so every
request goes to /generate as `text`: a workload's token ids decoded, a turn's prompt being its
parent's prompt + the parent's answer + its own new text.

Metrics: aggregate hit rate (sum of cached_tokens / sum of prompt_tokens over the answers),
requests per worker, throughput, failed requests. Prints a table, writes JSON.

Run:  python benchmarks/fleet_routing.py --workers 4 [--model PATH] [--out FILE.json]
Needs sglang-router (pip install 'radixserve[fleet]'). Without --model it serves a tiny
random Llama built on the spot (SmolLM2's tokenizer borrowed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from soak import build_tiny_model

from radixserve.config import FleetConfig, ServerConfig
from radixserve.fleet.launch import (
    Child,
    router_ready,
    stop_all,
    wait_until,
    worker_children,
    worker_healthy,
)
from radixserve.fleet.router import require_router, router_command
from radixserve_bench.report import save_report
from radixserve_bench.systems import free_port
from radixserve_bench.workloads import Workload, default_tokenizer, make_workload

BALANCED_ROUTER_ARGS = "--balance-abs-threshold 2 --balance-rel-threshold 1.5"
"""cache_aware routes to the shortest queue sooner (sglang-router's default absolute
threshold is 64 requests, which CONCURRENCY never reaches: a system prompt shared by every
conversation then sends all of them to one worker)."""
POLICIES = {  # label -> (policy, extra router args)
    "cache_aware": ("cache_aware", ""),
    "cache_aware (balanced)": ("cache_aware", BALANCED_ROUTER_ARGS),
    "round_robin": ("round_robin", ""),
}
WORKLOADS = {  # name -> (generator, overrides of its "small" preset)
    "shared-prefix": ("shared-prefix", {"num_groups": 8, "prompts_per_group": 8}),
    "multi-turn": ("multi-turn", {"num_conversations": 8, "num_turns": 4}),
}
CONCURRENCY = 8
REQUEST_TIMEOUT_S = 120.0
NEVER = threading.Event()  # the stop event of wait_until: this script stops on its own
STARTUP_TIMEOUT_S = 600.0
FAILOVER_ROUTER_ARGS = (
    "--health-check-interval-secs 1 --health-failure-threshold 1 "
    "--cb-failure-threshold 2 --retry-max-retries 3"
)
"""Fast failover (sglang-router 0.3 defaults: health checks every 60 s, 3 failures to mark a
worker unhealthy, circuit opens after 10 failures, 5 retries)."""
KILL_RUNS = {  # label -> (policy, extra router args); each run kills one more worker
    "cache_aware, kill, defaults": ("cache_aware", ""),
    "cache_aware, kill, failover": ("cache_aware", FAILOVER_ROUTER_ARGS),
}


@dataclass
class RunResult:
    workload: str
    policy: str
    num_requests: int
    num_failed: int = 0
    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    requests_per_worker: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def row(self) -> dict:
        return asdict(self) | {
            "hit_rate": round(self.hit_rate, 4),
            "req_per_s": round(self.num_requests / self.wall_s, 2) if self.wall_s else 0.0,
            "out_tok_per_s": round(self.output_tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "errors": self.errors[:5],
        }


# ---- load ----------------------------------------------------------------------------------


class TextWorkload:
    """A workload's requests as text; a turn's prompt is built from its parent's answer."""

    def __init__(self, workload: Workload, tokenizer):
        self.workload = workload
        self.new_texts = [tokenizer.decode(r.new_ids) for r in workload.requests]

    def prompt(self, index: int, prompts: list[str], answers: list[str]) -> str:
        parent = self.workload.requests[index].parent
        head = "" if parent is None else prompts[parent] + answers[parent]
        return head + self.new_texts[index]


async def run_load(url: str, load: TextWorkload, result: RunResult, kill=None) -> None:
    """Sends every request of `load` to `url`; `kill` (if given) runs once half are done."""
    n = len(load.new_texts)
    prompts, answers = [""] * n, [""] * n
    done = [asyncio.Event() for _ in range(n)]
    slots = asyncio.Semaphore(CONCURRENCY)
    finished = 0
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal finished
        parent = load.workload.requests[i].parent
        if parent is not None:
            await done[parent].wait()
        async with slots:
            prompts[i] = load.prompt(i, prompts, answers)
            answers[i] = await send(session, url, prompts[i], load.workload.requests[i], result)
        done[i].set()
        finished += 1
        if kill is not None and finished == n // 2:
            kill()

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, i) for i in range(n)))
    result.wall_s = time.perf_counter() - start


async def send(session, url: str, prompt: str, request, result: RunResult) -> str:
    """One /generate; its answer's text ("" when it failed, so that the turn after it runs)."""
    sampling = {"max_new_tokens": request.output_len, "temperature": 0, "ignore_eos": True}
    body = {"text": prompt, "sampling_params": sampling}
    try:
        async with session.post(url + "/generate", json=body) as resp:
            payload = await resp.json(content_type=None)
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {str(payload)[:200]}")
    except Exception as exc:  # a lost request is what this benchmark counts
        result.num_failed += 1
        result.errors.append(f"{type(exc).__name__}: {exc}")
        return ""
    meta = payload["meta_info"]
    result.prompt_tokens += meta["prompt_tokens"]
    result.cached_tokens += meta["cached_tokens"]
    result.output_tokens += meta["completion_tokens"]
    return payload["text"]


# ---- processes -----------------------------------------------------------------------------


def start_workers(model: str, num_workers: int) -> list[Child]:
    config = FleetConfig(workers=num_workers)
    workers = worker_children(config, ServerConfig(), {"model": model, "device": "cpu"})
    for worker in workers:  # each on a free port rather than consecutive ones
        port = free_port()
        worker.command[worker.command.index("--port") + 1] = str(port)
        worker.url = f"http://127.0.0.1:{port}"
        worker.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for worker in workers:
        if not wait_until(worker, lambda w=worker: worker_healthy(w.url), deadline, NEVER):
            raise RuntimeError(f"{worker.name} did not start")
    return workers


def start_router(workers: list[Child], policy: str, extra_args: str = "") -> Child:
    port = free_port()
    urls = [w.url for w in workers if w.alive]
    command = router_command(
        urls, "127.0.0.1", port, policy, log_level="warning", extra_args=extra_args
    )
    router = Child(f"router ({policy})", command, f"http://127.0.0.1:{port}")
    router.start()
    deadline = time.monotonic() + 60
    if not wait_until(router, lambda: router_ready(router.url, len(urls)), deadline, NEVER):
        raise RuntimeError("router did not get ready")
    return router


async def worker_requests(workers: list[Child]) -> list[int]:
    """Each worker's count of requests so far (-1 for a dead one)."""
    counts = []
    async with aiohttp.ClientSession() as session:
        for worker in workers:
            try:
                async with session.get(worker.url + "/server_info") as resp:
                    counts.append((await resp.json())["stats"]["num_requests"])
            except aiohttp.ClientError:
                counts.append(-1)
    return counts


async def flush(workers: list[Child]) -> None:
    async with aiohttp.ClientSession() as session:
        for worker in workers:
            if worker.alive:
                async with session.post(worker.url + "/flush_cache") as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"{worker.name}: flush_cache answered {resp.status}")


# ---- runs ----------------------------------------------------------------------------------


def measure(workers, load: TextWorkload, name: str, label: str, kill=None) -> RunResult:
    """One run: flushed caches, a router for `label` ("single": worker 0 alone), the load."""
    asyncio.run(flush(workers))
    before = asyncio.run(worker_requests(workers))
    router = None
    if label != "single":
        policy, extra = (POLICIES | KILL_RUNS)[label]
        router = start_router(workers, policy, extra)
    url = router.url if router else workers[0].url
    result = RunResult(name, label, len(load.new_texts))
    try:
        asyncio.run(run_load(url, load, result, kill))
    finally:
        if router:
            stop_all([router])
    after = asyncio.run(worker_requests(workers))
    result.requests_per_worker = [a - b if a >= 0 else -1 for a, b in zip(after, before)]
    return result


def run_all(model: str, num_workers: int) -> list[RunResult]:
    tokenizer = default_tokenizer()
    workers = start_workers(model, num_workers)
    results = []
    loads = {name: text_workload(name, tokenizer) for name in WORKLOADS}
    try:
        for name, load in loads.items():
            for label in ("single", *POLICIES):
                results.append(measure(workers, load, name, label))
                print_row(results[-1])
        # shared-prefix spreads over every worker, so the one killed has work in flight;
        # first with the router's default failover settings, then with FAILOVER_ROUTER_ARGS
        for label, victim in zip(KILL_RUNS, (workers[-1], workers[-2])):
            kill = lambda v=victim: os.kill(v.proc.pid, signal.SIGKILL)  # noqa: E731
            results.append(measure(workers, loads["shared-prefix"], "shared-prefix", label, kill))
            print_row(results[-1])
    finally:
        stop_all(workers)
    return results


def text_workload(name: str, tokenizer) -> TextWorkload:
    generator, overrides = WORKLOADS[name]
    workload = make_workload(generator, tokenizer, preset="small", overrides=overrides)
    return TextWorkload(workload, tokenizer)


def print_row(r: RunResult) -> None:
    row = r.row()
    print(
        f"{r.workload:<14} {r.policy:<23} {r.num_requests:>4} {r.num_failed:>6} "
        f"{row['hit_rate']:>8.3f} {row['req_per_s']:>7.2f} {row['out_tok_per_s']:>8.1f}  "
        f"{r.requests_per_worker}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", help="model to serve; default: a tiny random Llama")
    p.add_argument("--out", default="bench_results/fleet_routing.json")
    args = p.parse_args(argv)
    if args.workers < len(KILL_RUNS) + 1:
        p.error(f"--workers must be >= {len(KILL_RUNS) + 1}: the failover runs kill one each")
    require_router()
    print(f"{'workload':<14} {'policy':<23} {'reqs':>4} {'failed':>6} {'hit rate':>8} "
          f"{'req/s':>7} {'out tok/s':>8}  requests per worker")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_tiny_model(Path(tmp) / "tiny"))
        results = run_all(model, args.workers)
    report = {"workers": args.workers, "model": args.model or "tiny random Llama",
              "concurrency": CONCURRENCY, "failover_router_args": FAILOVER_ROUTER_ARGS,
              "runs": [r.row() for r in results]}  # fmt: skip
    save_report(report, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
