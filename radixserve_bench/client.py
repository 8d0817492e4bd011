"""Online load generation: a workload's requests against a server, at a rate or a concurrency.

Request i is sent at its arrival slot (Poisson / gamma spaced, or all at once for `inf`),
but not before its parent finished: a follow-up turn needs the real previous answer. Under
`max_concurrency` the ready requests queue for a slot in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from radixserve_bench.metrics import compute_metrics, engine_counter_delta
from radixserve_bench.record import BenchRun, RequestResult
from radixserve_bench.workloads import Workload

DEFAULT_PAGE_SIZE = 16
CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError)


@dataclass
class LoadShape:
    """How requests are offered to the system under test."""

    request_rate: float = math.inf
    """Requests per second with Poisson arrivals (inf: all at once); a follow-up turn goes
    at its slot or when its previous turn finishes, whichever is later."""
    max_concurrency: int | None = None
    """Most requests in flight at once (default: no limit)."""
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival times: 1 is Poisson, lower is burstier (vLLM's)."""
    num_warmup: int = 2
    """Warm-up requests on unrelated prompts before the measured run; the cache is flushed
    after them where the backend can."""


def load_metrics(load: LoadShape) -> dict:
    """The offered load, reported beside the metrics as vLLM does."""
    return {"max_concurrency": load.max_concurrency, "request_rate": load.request_rate}


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request may go; the first goes at 0."""
    if num == 0:
        return []
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0; got {rate}, {burstiness}")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


class OnlineRun:
    """Sends one workload through a backend and records every request."""

    def __init__(self, session, backend, workload: Workload, load: LoadShape, seed: int, bar):
        self.session, self.backend, self.workload, self.bar = session, backend, workload, bar
        num = len(workload.requests)
        self.results = [RequestResult(i, turn=r.turn) for i, r in enumerate(workload.requests)]
        self.prompts: list[list[int]] = [[] for _ in range(num)]
        self.outputs: list[list[int]] = [[] for _ in range(num)]
        self.done = [asyncio.Event() for _ in range(num)]
        self.arrivals = arrival_times(num, load.request_rate, load.burstiness, seed)
        limit = load.max_concurrency
        self.gate = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
        self.start = 0.0

    async def run(self, time_limit: float | None = None) -> tuple[list[RequestResult], float]:
        """Every request's result and the wall time from the first send to the last answer;
        after `time_limit` seconds the requests still out are dropped and count as failed."""
        self.start = time.perf_counter()
        sends = asyncio.gather(*(self._one(i) for i in range(len(self.results))))
        try:
            await asyncio.wait_for(sends, time_limit)
        except TimeoutError:
            for result in self.results:
                if not result.success and not result.error:
                    result.fail(f"not finished within the {time_limit:g} s cap")
        return self.results, time.perf_counter() - self.start

    async def _one(self, index: int) -> None:
        try:
            await asyncio.sleep(max(0.0, self.start + self.arrivals[index] - time.perf_counter()))
            if await self._parent_ok(index):
                async with self.gate:
                    await self._send(index)
        finally:
            self.done[index].set()
            self.bar.update(1)

    async def _parent_ok(self, index: int) -> bool:
        parent = self.workload.requests[index].parent
        if parent is None:
            return True
        await self.done[parent].wait()
        if not self.results[parent].success:
            self.results[index].fail(f"parent request {parent} failed")
        return self.results[parent].success

    async def _send(self, index: int) -> None:
        result = self.results[index]
        prompt = self.workload.prompt_ids(index, self.prompts, self.outputs)
        self.prompts[index] = result.prompt_ids = prompt
        result.start_time = time.perf_counter() - self.start
        try:
            output_len = self.workload.requests[index].output_len
            await self.backend.generate(self.session, prompt, output_len, result)
        except CLIENT_ERRORS as exc:
            result.fail(f"{type(exc).__name__}: {exc}")
        self.outputs[index] = result.output_ids


def progress_bar(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled)


async def warm_up(session, backend, warmup: Workload | None) -> None:
    """Runs the warm-up requests, then empties the server's prefix cache if it can."""
    if warmup is None or not warmup.requests:
        return
    with progress_bar(len(warmup.requests), "warm-up", False) as bar:
        await OnlineRun(session, backend, warmup, LoadShape(), 0, bar).run()
    with contextlib.suppress(*CLIENT_ERRORS):
        await backend.flush_cache(session)


async def run_online(
    workload: Workload,
    backend,
    load: LoadShape,
    seed: int = 0,
    warmup: Workload | None = None,
    page_size: int | None = None,
    system: str | None = None,
    progress: bool = True,
    time_limit: float | None = None,
) -> BenchRun:
    """Benchmarks the server behind `backend` on `workload`; page_size None asks the server;
    `time_limit` caps the measured run (seconds, see OnlineRun.run)."""
    async with bench_session() as session:
        await backend.prepare(session)
        await warm_up(session, backend, warmup)
        before = await _server_info(session, backend)
        system = system or backend.name
        with progress_bar(len(workload.requests), system, progress) as bar:
            online = OnlineRun(session, backend, workload, load, seed, bar)
            results, duration = await online.run(time_limit)
        info = await _server_info(session, backend)
    page_size = page_size or info.get("page_size") or DEFAULT_PAGE_SIZE
    metrics = compute_metrics(results, duration, page_size) | load_metrics(load)
    return BenchRun(system, backend.name, metrics, results, server_run_info(backend, before, info))


def bench_session() -> aiohttp.ClientSession:
    """A session that opens a fresh connection per request, as vLLM's benchmark client does.

    A pooled keep-alive connection the server has already closed fails the next request with
    `ClientOSError: Can not write request body` (llama-server closes idle ones), which would
    count the client's reuse against the server; a loopback connect costs ~0.1 ms.
    """
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=connector)


def server_run_info(backend, before: dict, after: dict) -> dict:
    """The server's URL and info, and (radixserve) its engine counters of the measured run."""
    info = {"url": backend.url, "server": after}
    if "stats" in before and "stats" in after:
        info["engine_counters"] = engine_counter_delta(before["stats"], after["stats"])
    return info


async def _server_info(session, backend) -> dict:
    try:
        return await backend.server_info(session)
    except CLIENT_ERRORS:
        return {}
