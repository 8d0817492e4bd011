"""Offline mode: a workload through `radixserve.Engine` in-process, no HTTP.

Requests go through the engine's request stream, driven in lockstep (`client.lockstep()`:
the core thread stops and this loop steps the core itself, submitting in between): every
request's tokens are timed at the step that produced them, and a follow-up turn is submitted
in the step right after its parent finished, so `bench simulate` can reproduce the run
exactly. Requests wait in workload order for one of `max_concurrency` slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from radixserve.client.client import OutputStream
from radixserve.client.request_builder import GenerateArgs
from radixserve.engine.protocol import RequestOutput
from radixserve_bench.backends import greedy_params
from radixserve_bench.client import LoadShape, load_metrics, progress_bar
from radixserve_bench.metrics import compute_metrics, engine_counter_delta
from radixserve_bench.record import BenchRun, RequestResult
from radixserve_bench.workloads import Workload


class OfflineRun:
    """Feeds a workload to an Engine's request stream and records every request."""

    def __init__(self, engine, workload: Workload, max_concurrency: int | None, bar):
        self.engine, self.workload, self.bar = engine, workload, bar
        num = len(workload.requests)
        self.limit = max_concurrency or num
        self.results = [RequestResult(i, turn=r.turn) for i, r in enumerate(workload.requests)]
        self.prompts: list[list[int]] = [[] for _ in range(num)]
        self.outputs: list[list[int]] = [[] for _ in range(num)]
        self.pending = list(range(num))
        self.finished = [False] * num
        self.in_flight: set[int] = set()
        self.start = 0.0

    def run(self) -> tuple[list[RequestResult], float]:
        """Every request's result and the wall time from the first submission to the last."""
        return asyncio.run(self._run())

    async def _run(self) -> tuple[list[RequestResult], float]:
        with self.engine.client.lockstep() as self.client:
            return await self._run_steps()

    async def _run_steps(self) -> tuple[list[RequestResult], float]:
        self.streams: dict[int, OutputStream] = {}
        self.start = time.perf_counter()
        self._submit_ready()
        while self.in_flight:
            self.client.step()
            await asyncio.sleep(0)  # lets the step's deltas reach the streams' queues
            elapsed = time.perf_counter() - self.start
            for index in sorted(self.in_flight):
                queue = self.streams[index].queue
                while not queue.empty():
                    self._record(index, queue.get_nowait()[1], elapsed)
            self._submit_ready()
        return self.results, time.perf_counter() - self.start

    def _submit_ready(self) -> None:
        waiting = []
        for index in self.pending:
            parent = self.workload.requests[index].parent
            if parent is not None and not self.finished[parent]:
                waiting.append(index)
            elif parent is not None and not self.results[parent].success:
                self._finish_failed(index, f"parent request {parent} failed")
            elif len(self.in_flight) < self.limit:
                self._submit(index)
            else:
                waiting.append(index)
        self.pending = waiting

    def _submit(self, index: int) -> None:
        result = self.results[index]
        prompt = self.workload.prompt_ids(index, self.prompts, self.outputs)
        self.prompts[index] = result.prompt_ids = prompt
        result.start_time = time.perf_counter() - self.start
        params = greedy_params(self.workload.requests[index].output_len)
        try:
            specs, _ = self.engine.builder.build(
                GenerateArgs(input_ids=prompt, sampling_params=params)
            )
        except ValueError as exc:
            return self._finish_failed(index, str(exc))
        self.in_flight.add(index)
        self.streams[index] = self.client.submit(specs)

    def _record(self, index: int, output: RequestOutput, elapsed: float) -> None:
        result = self.results[index]
        if output.new_token_ids:
            result.add_chunk(elapsed - result.start_time, len(output.new_token_ids))
            result.output_ids = result.output_ids + output.new_token_ids
        result.cached_tokens = output.cached_tokens
        if output.finish_reason is not None:
            self._finish(index, output, elapsed)

    def _finish(self, index: int, output: RequestOutput, elapsed: float) -> None:
        result = self.results[index]
        result.e2e = elapsed - result.start_time
        result.prompt_len, result.output_len = len(self.prompts[index]), len(result.output_ids)
        aborted = output.finish_reason.is_abort
        result.success = not aborted
        result.error = output.finish_reason.message if aborted else ""
        self.outputs[index] = result.output_ids
        self.in_flight.discard(index)
        self.finished[index] = True
        self.bar.update(1)

    def _finish_failed(self, index: int, error: str) -> None:
        self.results[index].fail(error)
        self.finished[index] = True
        self.bar.update(1)


def warm_up_engine(engine, warmup: Workload | None) -> None:
    """Runs the warm-up requests as one batch, then empties the prefix cache."""
    if warmup is None or not warmup.requests:
        return
    prompts = warmup.prompts()
    params = [greedy_params(r.output_len) for r in warmup.requests]
    engine.generate(input_ids=prompts, sampling_params=params, progress_bar=False)
    engine.flush_cache()


def run_offline(
    engine,
    workload: Workload,
    max_concurrency: int | None = None,
    warmup: Workload | None = None,
    system: str = "offline",
    progress: bool = True,
) -> BenchRun:
    """Benchmarks a `radixserve.Engine` on `workload` (the caller owns and shuts the engine)."""
    warm_up_engine(engine, warmup)
    before = engine.get_stats()
    with progress_bar(len(workload.requests), system, progress) as bar:
        results, duration = OfflineRun(engine, workload, max_concurrency, bar).run()
    metrics = compute_metrics(results, duration, engine.runner.pool.page_size)
    metrics |= load_metrics(LoadShape(max_concurrency=max_concurrency))
    return BenchRun(system, "offline", metrics, results, engine_info(engine, before))


def engine_info(engine, before: dict) -> dict[str, Any]:
    """The engine's model, device and configs, and its counters of the measured run."""
    stats = engine.get_stats()
    return {
        "model": engine.model_name,
        "device": str(engine.runner.device),
        "scheduler": dataclasses.asdict(engine.scheduler.config),
        "stats": stats,
        "engine_counters": engine_counter_delta(before, stats),
    }
