"""Autoscaling: a bursty agent workload on a fixed 1-worker, a fixed 2-worker and an
autoscaled (1 to 2) `radixserve fleet`: P99 TTFT and worker-seconds, one run each.

Workload (the same for every fleet): IDLE_BEFORE_S of nothing, then a burst of BURST_S in which
AGENTS agents run sessions back to back, each TURNS turns in a row (a turn's prompt is the
previous one's plus its answer plus new text, as a tool-calling agent grows its context; a
session under way when the burst ends is finished), then idle until
the autoscaled fleet has drained back to --min-workers and IDLE_AFTER_S more (every fleet
idles as long after its burst as the autoscaled one did).
Every fleet runs through the same code path (`--min-workers N --max-workers N` is a fixed
fleet of N), so each has its fleet port, whose /fleet/stats is sampled every SAMPLE_S:
worker-seconds = the integral of running workers (starting, serving or draining) over the
run. TTFT is the time to the first streamed token, measured by the client through the router.

For the autoscaled fleet it also reports where its time went (from the fleet port's decisions
and scrapes): burst start -> up decision, up -> the new worker serving, burst end -> down
decision, burst end -> back at --min-workers, and the P99 TTFT of the requests sent before
the second worker served against those sent after.

Workers are capacity-limited on purpose (--max-running-requests, one core each) so that a
burst queues on a small machine; the numbers say how the policy follows a queue, not how
fast a model is.

Run:  python benchmarks/autoscale.py [--model PATH] [--out FILE.json]
Needs sglang-router (pip install 'radixserve[fleet]'). Without --model it serves a tiny
random Llama built on the spot (SmolLM2's tokenizer borrowed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from soak import build_tiny_model

from radixserve_bench.systems import free_port_run

AGENTS = 12
BURST_S = 60.0
"""Longer than a worker's start on a loaded machine, or no fleet could follow it."""
TURNS = 4
TURN_TOKENS = 24
NEW_TEXT_TOKENS = 40
IDLE_BEFORE_S = 20.0
IDLE_AFTER_S = 20.0
"""Idle after the autoscaled fleet is back at --min-workers (every fleet idles as long)."""
SAMPLE_S = 0.5
SCALE_FLAGS = ["--scale-up-queue-per-worker", "2", "--scale-down-idle-s", "4"]
SCALE_FLAGS += ["--scale-up-ttft-target-s", "0.5", "--scale-up-ttft-slow-fraction", "0.1"]
SCALE_FLAGS += ["--scale-interval-s", "1", "--scale-cooldown-s", "4"]
WORKER_FLAGS = ["--max-running-requests", "2", "--max-total-tokens", "16384"]
FLEETS = {"fixed-1": (1, 1), "fixed-2": (2, 2), "autoscaled 1-2": (1, 2)}
DRAIN_WAIT_S = 120.0
"""How long after the burst the run waits for the autoscaled fleet to shrink back."""


@dataclass
class RunResult:
    fleet: str
    num_requests: int
    num_failed: int
    p50_ttft_s: float
    p99_ttft_s: float
    worker_seconds: float
    duration_s: float
    max_workers_seen: int
    idle_after_s: float  # after the burst
    # where the autoscaled fleet's time goes (None for the fixed ones), from its fleet port's
    # decisions and scrapes (the fleet's clock is this one: both CLOCK_MONOTONIC)
    up_after_s: float | None = None  # burst start -> the up decision
    worker_start_s: float | None = None  # up decision -> the new worker scraped as serving
    down_after_s: float | None = None  # burst end -> the down decision
    back_at_min_s: float | None = None  # burst end -> min workers, none starting or draining
    p99_ttft_one_worker_s: float | None = None  # requests sent before the second served
    p99_ttft_two_workers_s: float | None = None  # the rest


class Fleet:
    """`radixserve fleet` in a subprocess with its fleet port; `running()` counts workers."""

    def __init__(self, model: str, min_workers: int, max_workers: int) -> None:
        ports = [free_port_run(n) for n in (1, max_workers, 1, 1)]
        self.url = f"http://127.0.0.1:{ports[0]}"
        self.fleet_url = f"http://127.0.0.1:{ports[2]}"
        command = [sys.executable, "-m", "radixserve.cli", "fleet", model, *SCALE_FLAGS]
        command += ["--min-workers", str(min_workers), "--max-workers", str(max_workers)]
        command += ["--router-port", str(ports[0]), "--worker-base-port", str(ports[1])]
        command += ["--fleet-port", str(ports[2]), "--policy", "round_robin", *WORKER_FLAGS]
        command += ["--router-args", f"--prometheus-port {ports[3]}"]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in self.proc.stdout:
            if "fleet ready at" in line:
                break
        else:
            raise RuntimeError(f"the fleet exited with code {self.proc.wait()}")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stats(self) -> dict:
        with urllib.request.urlopen(self.fleet_url + "/fleet/stats", timeout=5) as response:
            return json.loads(response.read())

    def running(self) -> int:
        n = self.stats()["num_workers"]
        return n["starting"] + n["serving"] + n["draining"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


class WorkerClock:
    """Samples the running-worker count every SAMPLE_S; worker-seconds = its integral."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet, self.worker_seconds, self.max_seen = fleet, 0.0, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self.done.wait(SAMPLE_S):
            count, now = self.fleet.running(), time.monotonic()
            self.worker_seconds += count * (now - last)
            self.max_seen, last = max(self.max_seen, count), now

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


async def agent(session: aiohttp.ClientSession, url: str, index: int, ttfts: list, fails: list):
    """Sessions of TURNS turns until the burst ends; streams each turn, records its TTFT."""
    end, num_sessions = time.monotonic() + BURST_S, 0
    while time.monotonic() < end:
        await agent_session(session, url, index * 1000 + num_sessions, ttfts, fails)
        num_sessions += 1


async def agent_session(session, url: str, seed: int, ttfts: list, fails: list) -> None:
    """TURNS turns, each prompt the last one + its answer + new tokens."""
    context: list[int] = []
    for turn in range(TURNS):
        context += [(seed * 977 + turn * 131 + j * 17) % 4000 + 200 for j in range(NEW_TEXT_TOKENS)]
        params = {"max_new_tokens": TURN_TOKENS, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": context, "sampling_params": params, "stream": True}
        start, first, last = time.perf_counter(), None, None
        async with session.post(url + "/generate", json=body) as response:
            if response.status != 200:
                fails.append(response.status)
                return
            async for line in response.content:
                if line.startswith(b"data: {"):
                    first = first or time.perf_counter()
                    last = line
        ttfts.append((start, first - start))
        context += json.loads(last[len(b"data: ") :])["output_ids"]


async def burst(url: str) -> tuple[list[tuple[float, float]], list[int]]:
    """(sent at, TTFT) of every turn; the statuses of the failed ones."""
    ttfts: list[tuple[float, float]] = []
    fails: list[int] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(agent(session, url, i, ttfts, fails) for i in range(AGENTS)))
    return ttfts, fails


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def run_one(model: str, name: str, idle_after_s: float | None) -> RunResult:
    """One fleet through idle, burst, idle; `idle_after_s` None: until it is back at its
    minimum (the autoscaled run), else that many seconds."""
    low, high = FLEETS[name]
    fleet = Fleet(model, low, high)
    try:
        clock, start = WorkerClock(fleet), time.monotonic()
        time.sleep(IDLE_BEFORE_S)
        burst_start = time.monotonic()
        sent, fails = asyncio.run(burst(fleet.url))
        burst_end = time.monotonic()
        if idle_after_s is None:
            while fleet.running() > low and time.monotonic() - burst_end < DRAIN_WAIT_S:
                time.sleep(SAMPLE_S)
            back_at_min_s = time.monotonic() - burst_end
            time.sleep(IDLE_AFTER_S)
        else:
            time.sleep(idle_after_s)
        clock.stop()
        duration = time.monotonic() - start
        ttfts = [ttft for _, ttft in sent]
        result = RunResult(
            fleet=name,
            num_requests=len(ttfts) + len(fails),
            num_failed=len(fails),
            p50_ttft_s=quantile(ttfts, 0.5),
            p99_ttft_s=quantile(ttfts, 0.99),
            worker_seconds=clock.worker_seconds,
            duration_s=duration,
            max_workers_seen=clock.max_seen,
            idle_after_s=time.monotonic() - burst_end,
        )
        if low < high:
            result.back_at_min_s = back_at_min_s
            where_time_went(result, fleet.stats(), sent, burst_start, burst_end, low)
        return result
    finally:
        fleet.stop()


def where_time_went(
    result: RunResult, stats: dict, sent: list, burst_start: float, burst_end: float, low: int
) -> None:
    """Fills the autoscaled run's lags from its fleet port: decisions and per-scrape
    (time, serving workers, waiting) points, and splits the TTFTs at the second worker."""
    ups = [d["time"] for d in stats["decisions"] if d["action"] == "up"]
    downs = [d["time"] for d in stats["decisions"] if d["action"] == "down"]
    timeline = stats["timeline"]
    if ups:
        result.up_after_s = ups[0] - burst_start
        served = [t for t, n, _ in timeline if t >= ups[0] and n > low]
        if served:
            result.worker_start_s = served[0] - ups[0]
            before = [ttft for at, ttft in sent if at < served[0]]
            after = [ttft for at, ttft in sent if at >= served[0]]
            result.p99_ttft_one_worker_s = quantile(before, 0.99)
            result.p99_ttft_two_workers_s = quantile(after, 0.99)
    if downs:
        result.down_after_s = downs[-1] - burst_end


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model path (default: a tiny random Llama)")
    p.add_argument("--out", default="autoscale.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or str(build_tiny_model(Path(folder)))
        auto = run_one(model, "autoscaled 1-2", None)  # idle after until back at 1 worker
        others = [run_one(model, n, auto.idle_after_s) for n in ("fixed-1", "fixed-2")]
        results = [auto, *others]
    print(f"{'fleet':<16}{'requests':>9}{'failed':>7}{'P50 TTFT':>10}{'P99 TTFT':>10}"
          f"{'worker-s':>10}{'run s':>8}{'max w':>6}")  # fmt: skip
    for r in results:
        print(f"{r.fleet:<16}{r.num_requests:>9}{r.num_failed:>7}{r.p50_ttft_s:>10.3f}"
              f"{r.p99_ttft_s:>10.3f}{r.worker_seconds:>10.1f}{r.duration_s:>8.1f}"
              f"{r.max_workers_seen:>6}")  # fmt: skip
    lags = ("up_after_s", "worker_start_s", "down_after_s", "back_at_min_s")
    lags += ("p99_ttft_one_worker_s", "p99_ttft_two_workers_s")
    print("autoscaled: " + ", ".join(f"{k} {getattr(auto, k)}" for k in lags))
    report = {"agents": AGENTS, "turns": TURNS, "burst_s": BURST_S, "idle_before_s": IDLE_BEFORE_S}
    report |= {"idle_after_s": IDLE_AFTER_S, "runs": [asdict(r) for r in results]}
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
