"""The real Scheduler and radix cache on a workload, timed by a cost model instead of a model.

One `Simulation` feeds a workload to a Scheduler over a SimRunner, on a virtual clock:

    ready(i)  = max(arrival slot, parent's finish + delay_s)   Poisson slots, or all at 0
                (rate inf); delay_s: a tool call's pause (a root: its arrival offset)
    sent(i)   : the first step boundary after ready(i) with a free `max_concurrency` slot;
                ready requests go in workload order, as in the offline bench
    admitted  : the step that first schedules it;  first token / finish: the end of a step

Each step advances the clock by the cost of its batch. The step's real CPU time, minus the
fake forward, is the scheduler's own cost (matching, ordering, batch building, sampling).
A request's arrival_time is its submission number: the scheduler only orders by it.
With `retention_ttl_s`, session requests ask for retention and the pins' TTLs run on the
virtual clock; `priority_of` gives each request its `priority` (SGLang's field), which needs
`enable_priority_scheduling` as it does on the Engine.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.cache.hiradix_cache import create_hierarchical_cache
from radixserve.cache.radix_cache import create_prefix_cache
from radixserve.cache.retention import session_pin_key
from radixserve.config import CacheConfig, HiCacheConfig, SchedulerConfig
from radixserve.engine.protocol import PinRequest
from radixserve.engine.request import Req
from radixserve.engine.scheduler import Scheduler
from radixserve.sampling.params import SamplingParams
from radixserve_bench.backends import greedy_params
from radixserve_bench.client import arrival_times
from radixserve_bench.sim_runner import CostModel, SimRunner
from radixserve_bench.workloads import BenchRequest, Workload

MAX_IDLE_STEPS = 1000  # steps in a row without a forward: the scheduler is stuck


@dataclass
class SimLoad:
    """How requests are offered, on the virtual clock."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    burstiness: float = 1.0
    seed: int = 0


@dataclass
class RequestTimes:
    """One request's virtual times (seconds) and cache hit."""

    ready: float = 0.0
    sent: float | None = None
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_len: int = 0
    cached_tokens: int = 0
    cached_tokens_host: int = 0  # of those, loaded back from the hierarchical cache's tier
    error: str = ""


@dataclass
class SimResult:
    """Everything one run measured; `summarize` turns it into the reported numbers."""

    requests: list[RequestTimes]
    prompts: list[list[int]]
    outputs: list[list[int]]
    step_cpu_s: list[float] = field(default_factory=list)  # scheduler CPU, forward excluded
    step_num_reqs: list[int] = field(default_factory=list)  # requests in each step's batch
    makespan: float = 0.0  # virtual seconds from the first arrival to the last finish
    wall_s: float = 0.0  # real seconds the simulation took
    stats: dict = field(default_factory=dict)  # the scheduler's EngineStats


class Simulation:
    """Feeds one workload to one Scheduler over a SimRunner; `run()` once."""

    def __init__(
        self,
        workload: Workload,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        cost: CostModel | None = None,
        load: SimLoad | None = None,
        retention_ttl_s: float | None = None,
        hicache: HiCacheConfig | None = None,
        priority_of: Callable[[BenchRequest], int] | None = None,
    ):
        load = load or SimLoad()
        self.workload = workload
        self.retention_ttl_s = retention_ttl_s
        self.priority_of = priority_of
        if priority_of is not None and not scheduler_config.enable_priority_scheduling:
            raise ValueError("request priorities need enable_priority_scheduling (as the Engine)")
        self.runner = SimRunner(cache_config, cost or CostModel())
        self.scheduler = sim_scheduler(self.runner, scheduler_config, hicache)
        self.scheduler.pins.clock = lambda: self.now
        self.context_length = scheduler_config.context_length
        num = len(workload.requests)
        self.limit = load.max_concurrency or num
        self.slots = arrival_times(num, load.request_rate, load.burstiness, load.seed)
        self.children = children_of(workload)
        self.times = [RequestTimes() for _ in range(num)]
        self.prompts: list[list[int]] = [[] for _ in range(num)]
        self.outputs: list[list[int]] = [[] for _ in range(num)]
        self.upcoming: list[tuple[float, int]] = []  # heap of (ready time, index)
        for i, req in enumerate(workload.requests):
            if req.parent is None:
                self._make_ready(i, max(self.slots[i], req.delay_s))
        self.released: list[int] = []  # heap of indices that are ready, waiting for a slot
        self.released_at: dict[int, float] = {}  # index -> the boundary that released it
        self.in_flight: dict[Req, int] = {}
        self.result = SimResult(self.times, self.prompts, self.outputs)
        self.now = 0.0
        self.num_submitted = 0

    def run(self) -> SimResult:
        """Runs every request to the end; returns what was measured."""
        start = time.perf_counter()
        idle = 0
        while self.upcoming or self.released or self.in_flight:
            self._release_ready()
            self._submit_released()
            if self.in_flight:
                idle = 0 if self._step() else idle + 1
                if idle > MAX_IDLE_STEPS:
                    raise RuntimeError(f"the scheduler ran {idle} steps without a forward")
            elif self.upcoming:  # nothing to run until the next arrival
                self.now = max(self.now, self.upcoming[0][0])
        self.scheduler.cache.check_integrity(self.scheduler.held_pages())
        self.result.makespan = self.now
        self.result.wall_s = time.perf_counter() - start
        self.result.stats = self.scheduler.stats.as_dict()
        return self.result

    # ---- arrivals ------------------------------------------------------------------------

    def _make_ready(self, index: int, ready: float) -> None:
        self.times[index].ready = ready
        heapq.heappush(self.upcoming, (ready, index))

    def _release_ready(self) -> None:
        while self.upcoming and self.upcoming[0][0] <= self.now:
            _, index = heapq.heappop(self.upcoming)
            heapq.heappush(self.released, index)
            self.released_at[index] = self.now

    def _submit_released(self) -> None:
        while self.released and len(self.in_flight) < self.limit:
            index = heapq.heappop(self.released)
            times = self.times[index]
            # Sent in the first boundary after it became ready: it was in the server's queue
            # since then; held back by max_concurrency: sent when a slot freed, i.e. now.
            times.sent = times.ready if self.released_at.pop(index) == self.now else self.now
            self._submit(index)

    def _submit(self, index: int) -> None:
        prompt = self.workload.prompt_ids(index, self.prompts, self.outputs)
        self.prompts[index] = prompt
        times = self.times[index]
        times.prompt_len = len(prompt)
        params = SamplingParams.from_dict(greedy_params(self.workload.requests[index].output_len))
        error = self._check_length(prompt, params)
        if error:
            return self._fail(index, error)
        self.num_submitted += 1
        req = Req(str(index), prompt, params, seed=0, arrival_time=float(self.num_submitted))
        req.session_id = self.workload.requests[index].session_id
        if self.priority_of is not None:
            req.priority = self.priority_of(self.workload.requests[index])
        if req.session_id is not None and self.retention_ttl_s is not None:
            req.pin = PinRequest(session_pin_key(req.session_id), self.retention_ttl_s)
        self.scheduler.add_request(req)
        self.in_flight[req] = index

    def _check_length(self, prompt: list[int], params: SamplingParams) -> str:
        """The Engine's length rules (RequestBuilder.check_length), as an error message."""
        if self.context_length is not None:
            if len(prompt) >= self.context_length:
                return (
                    f"prompt has {len(prompt)} tokens; the context length is {self.context_length}"
                )
            room = self.context_length - len(prompt)
            if params.max_new_tokens > room:
                return (
                    f"max_new_tokens is {params.max_new_tokens} but the context length is "
                    f"{self.context_length} and the prompt has {len(prompt)} tokens: at most "
                    f"{room} tokens can be generated"
                )
        if len(prompt) + params.max_new_tokens > self.runner.pool.capacity_tokens:
            return (
                f"prompt + max_new_tokens exceed the KV pool ({self.runner.pool.capacity_tokens})"
            )
        return ""

    # ---- steps ---------------------------------------------------------------------------

    def _step(self) -> bool:
        """One scheduler step on the clock; False if it ran no forward."""
        start_time, wall_before = self.now, self.runner.wall_seconds
        forwards = self.scheduler.stats.forward_steps
        copied = tier_pages_copied(self.scheduler.cache)
        start = time.perf_counter()
        changed = self.scheduler.step()
        elapsed = time.perf_counter() - start
        forwarded = self.scheduler.stats.forward_steps > forwards
        copied = tier_pages_copied(self.scheduler.cache) - copied
        self.now += copied * self.runner.pool.page_size * self.runner.cost.tier_copy_cost
        if forwarded:
            self.now += self.runner.last_seconds
            self.result.step_cpu_s.append(elapsed - (self.runner.wall_seconds - wall_before))
            self.result.step_num_reqs.append(self.runner.last_num_reqs)
        for req in changed:
            self._record(req, start_time)
        return forwarded

    def _record(self, req: Req, start_time: float) -> None:
        index = self.in_flight.get(req)
        if index is None:
            return
        times = self.times[index]
        if times.admitted is None:
            times.admitted = start_time
            times.cached_tokens = req.cached_tokens
            times.cached_tokens_host = req.cached_tokens_host
        if times.first_token is None and req.output_ids:
            times.first_token = self.now
        if req.finished:
            del self.in_flight[req]
            times.finished = self.now
            self.outputs[index] = list(req.output_ids)
            if req.finish_reason.is_abort:
                return self._fail(index, req.finish_reason.message)
            for child in self.children[index]:
                pause = self.workload.requests[child].delay_s
                self._make_ready(child, max(self.slots[child], self.now + pause))

    def _fail(self, index: int, error: str) -> None:
        """Marks a request failed, and with it every later turn of its conversation."""
        self.times[index].error = error
        for child in self.children[index]:
            self._fail(child, f"parent request {index} failed")


def sim_scheduler(
    runner: SimRunner, config: SchedulerConfig, hicache: HiCacheConfig | None = None
) -> Scheduler:
    """The real Scheduler and prefix cache (over two tiers with `hicache` enabled) over a
    simulated runner (no EOS, no tokenizer)."""
    pool = runner.pool
    if hicache is not None and hicache.enable_hierarchical_cache:
        hicache.verify()
        cache = create_hierarchical_cache(pool, hicache, model_fingerprint="simulated")
    else:
        cache = create_prefix_cache(config.disable_radix_cache, pool.allocator, pool.page_size)
    return Scheduler(runner, cache, config)


def tier_pages_copied(cache: object) -> int:
    """Pages a hierarchical cache copied between pool and tier so far (0 without a tier)."""
    return getattr(cache, "pages_to_host", 0) + getattr(cache, "pages_to_device", 0)


def children_of(workload: Workload) -> list[list[int]]:
    """Each request's follow-ups (the requests naming it as parent)."""
    children: list[list[int]] = [[] for _ in workload.requests]
    for i, req in enumerate(workload.requests):
        if req.parent is not None:
            children[req.parent].append(i)
    return children


def simulate(
    workload: Workload,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost: CostModel | None = None,
    load: SimLoad | None = None,
    retention_ttl_s: float | None = None,
    hicache: HiCacheConfig | None = None,
    priority_of: Callable[[BenchRequest], int] | None = None,
) -> SimResult:
    """Runs `workload` through the real scheduler on a simulated model."""
    simulation = Simulation(
        workload, scheduler_config, cache_config, cost, load, retention_ttl_s, hicache, priority_of
    )
    return simulation.run()
