"""The agent-sessions workload on a real `radixserve.Engine`, in real time: each session
sleeps through its tool-call pauses, the flood arrives at its offsets, and TTFT is the wall
time from sending a request to its first streamed token. Slower and noisier than the
simulator, but nothing in it is modelled."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixserve_bench.backends import greedy_params
from radixserve_bench.simulate import RequestTimes, SimResult, children_of
from radixserve_bench.workloads import BenchRequest, Workload


@dataclass
class LiveRun:
    engine: object  # radixserve.Engine
    workload: Workload
    retention_ttl_s: float | None  # None: plain LRU (no session fields sent)
    priority_of: Callable[[BenchRequest], int] | None = None  # None: no priority sent

    def run(self) -> SimResult:
        """Every request's times (seconds from the start), in the simulator's result shape."""
        return asyncio.run(self._run())

    async def _run(self) -> SimResult:
        num = len(self.workload.requests)
        self.times = [RequestTimes() for _ in range(num)]
        self.prompts: list[list[int]] = [[] for _ in range(num)]
        self.outputs: list[list[int]] = [[] for _ in range(num)]
        self.children = children_of(self.workload)
        self.start = time.perf_counter()
        roots = [i for i, r in enumerate(self.workload.requests) if r.parent is None]
        await asyncio.gather(*(self._conversation(i) for i in roots))
        result = SimResult(self.times, self.prompts, self.outputs)
        result.makespan = time.perf_counter() - self.start
        return result

    async def _conversation(self, index: int) -> None:
        """A root after its offset, then each follow-up after its pause."""
        while index is not None:
            await asyncio.sleep(self.workload.requests[index].delay_s)
            await self._request(index)
            children = self.children[index]
            index = children[0] if children else None

    async def _request(self, index: int) -> None:
        req = self.workload.requests[index]
        prompt = self.workload.prompt_ids(index, self.prompts, self.outputs)
        self.prompts[index] = prompt
        times = self.times[index]
        times.prompt_len, times.sent = len(prompt), self._now()
        stream = await self.engine.async_generate(
            input_ids=prompt,
            sampling_params=greedy_params(req.output_len),
            stream=True,
            priority=None if self.priority_of is None else self.priority_of(req),
            **self._session_fields(req.session_id),
        )
        last = None
        async for last in stream:
            if times.first_token is None and last["output_ids"]:
                times.first_token = self._now()
        times.finished = self._now()
        times.cached_tokens = last["meta_info"]["cached_tokens"]
        details = last["meta_info"].get("cached_tokens_details") or {}
        times.cached_tokens_host = details.get("host", 0)
        self.outputs[index] = list(last["output_ids"])

    def _session_fields(self, session_id: str | None) -> dict:
        if session_id is None or self.retention_ttl_s is None:
            return {}
        return {"session_id": session_id, "retention": {"ttl_s": self.retention_ttl_s}}

    def _now(self) -> float:
        return time.perf_counter() - self.start
