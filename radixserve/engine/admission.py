"""Admission: which waiting requests join the running batch this step, and which running
request a retraction takes back out.

    waiting --order (policy, prefix matches)--> queue --dedupe--> try_admit --> running
                                                                  |  pages needed (uncached
                                                                  |  prompt + future output)
                                                                  |  <= free + reclaimable
                                                                  |     - reserved (running)
                                                                  v  else: stop admitting

A request is matched against the prefix cache (a match with tier-only pages is loaded back
into the pool once it is admitted), skipped while an admitted request is still computing an
uncached page it shares (in-batch dedupe: it hits that page later instead of computing it
twice), and admitted only if the pool can hold its uncached prompt plus the output that
every running request is still expected to produce (`NewTokenRatio`). The scheduler owns the
queues and the step; this class owns the arithmetic and the order.
"""

from __future__ import annotations

import time
from collections import deque

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.prefix_cache import MatchResult, PrefixCache
from radixserve.config import SchedulerConfig
from radixserve.engine.batch_builder import Work
from radixserve.engine.logprobs import cacheable_len
from radixserve.engine.new_token_ratio import NewTokenRatio
from radixserve.engine.policy import Aging, order_waiting
from radixserve.engine.req_pages import ReqPages
from radixserve.engine.request import Req, ReqState
from radixserve.engine.stats import EngineStats
from radixserve.token_ids import common_prefix_len

OUTPUT_ESTIMATE_CLIP = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: future tokens reserved
MAX_SORTED_QUEUE = 128  # longer waiting queues fall back to fcfs order, as in SGLang


class Admission:
    """Moves waiting requests into the running batch in policy order while pages allow;
    chooses the victim of a retraction."""

    def __init__(
        self,
        cache: PrefixCache,
        pool: KVPool,
        pages: ReqPages,
        config: SchedulerConfig,
        stats: EngineStats,
        ratio: NewTokenRatio,
    ):
        self.cache = cache
        self.pool = pool
        self.page_size = pool.page_size
        self.pages = pages
        self.config = config
        self.stats = stats
        self.ratio = ratio
        self._seq_keys: dict[Req, tuple[int, ...]] = {}
        self.lora = None  # the model's LoRA weights: their pool bounds a batch's adapters

    def admit(
        self,
        waiting: list[Req],
        running: list[Req],
        budget: int,
        leaders: list[Req],
        retracted: set[Req],
    ) -> list[Work]:
        """Admits waiting requests in policy order, moving each from `waiting` to `running`,
        within `budget` prefill tokens. `leaders`: requests prefilling already; `retracted`:
        requests retracted in this step, not readmitted before the next one."""
        keys = self._seq_keys
        self._seq_keys = {r: k for r, k in keys.items() if r.state is ReqState.WAITING}
        # readmitting a request retracted in this very step would undo its retraction
        candidates = [r for r in waiting if r not in retracted]
        full = len(running) >= self.config.max_running_requests
        if not candidates or budget <= 0 or full:
            return []  # nothing can join: skip ordering the queue, as SGLang does
        matches, queue = self._order(candidates)
        aging = Aging(candidates, self.config.schedule_max_bypass)
        admitted = self._admit_in_order(queue, matches, aging, budget, leaders, waiting, running)
        aging.commit(waiting)
        return admitted

    def retraction_victim(self, running: list[Req]) -> Req:
        """The running request holding the most own pages (the youngest of those; the
        lowest priority first, with priority scheduling)."""
        return max(running, key=self._retract_key)

    def _retract_key(self, req: Req) -> tuple[int, int, float]:
        priority = req.priority if self.config.enable_priority_scheduling else 0
        return (-priority, len(req.own_pages()), req.arrival_time)

    # ---- order and match -----------------------------------------------------------------

    def _order(self, candidates: list[Req]) -> tuple[dict[Req, MatchResult], deque[Req]]:
        """The candidates' prefix matches (none under fcfs) and the policy's order of them."""
        policy = self.config.schedule_policy
        if len(candidates) > MAX_SORTED_QUEUE:
            policy = "fcfs"  # matching every queued prompt each step would cost more than it saves
        matches = {} if policy == "fcfs" else {r: self._match(r) for r in candidates}
        ordered = order_waiting(
            candidates,
            policy,
            matches,
            self.config.schedule_max_bypass,
            self.cache.parent_of,
            by_priority=self.config.enable_priority_scheduling,
            tier_weight=self.config.schedule_tier_match_weight,
        )
        return matches, deque(ordered)

    def _match(self, req: Req) -> MatchResult:
        limit = cacheable_len(req)
        return self.cache.match_usable(self._seq_key(req), req.namespace, max_tokens=limit)

    def _seq_key(self, req: Req) -> tuple[int, ...]:
        """The request's sequence as a tuple, kept while it waits: lpm matches it every step.

        A sequence only grows, so an unchanged length means unchanged tokens.
        """
        key = self._seq_keys.get(req)
        if key is None or len(key) != req.seq_len:
            key = self._seq_keys[req] = tuple(req.seq_ids())
        return key

    # ---- admit ---------------------------------------------------------------------------

    def _admit_in_order(
        self,
        queue: deque[Req],
        matches: dict[Req, MatchResult],
        aging: Aging,
        budget: int,
        leaders: list[Req],
        waiting: list[Req],
        running: list[Req],
    ) -> list[Work]:
        admitted: list[Work] = []
        reserved = None  # pages promised to running requests, computed once needed
        evicted = self.stats.evicted_pages
        while queue and budget > 0 and len(running) < self.config.max_running_requests:
            req = queue.popleft()
            # An admission above may have evicted the node a queued match points to: match again.
            fresh = self.stats.evicted_pages == evicted
            match = (matches.get(req) if fresh else None) or self._match(req)
            # In-batch dedupe, starved requests included: the shared prefix is being computed;
            # hit it later (a wait bounded by the leader's remaining chunks) instead of
            # computing it twice. Requests behind a waiting follower may go meanwhile.
            if self._follows_leader(req, match.num_tokens, leaders):
                continue
            # --max-loras-per-batch: a request of an adapter the batch has no slot for waits,
            # those behind it whose adapter is in the batch go; once aging says it starved,
            # nothing more joins until the batch drains enough for its adapter
            if not self._adapter_fits(req, running):
                if aging.num_bypassed(req) >= self.config.schedule_max_bypass:
                    break
                continue
            if reserved is None:
                reserved = self._reserved_pages(running)
            work = self._try_admit(req, match, budget, reserved, bool(running))
            if work is None:
                break
            waiting.remove(req)
            running.append(req)
            admitted.append(work)
            leaders.append(req)
            budget -= work.num_new
            reserved += self._future_pages(req)
            queue = _put_first(aging.admit(req), queue)
        return admitted

    def _adapter_fits(self, req: Req, running: list[Req]) -> bool:
        """True if `req` runs on the base, on an adapter of the batch, or the LoRA pool has a
        slot to spare (the base model takes none)."""
        if self.lora is None or req.lora_id is None:
            return True
        adapters = {r.lora_id for r in running if r.lora_id is not None}
        return req.lora_id in adapters or len(adapters) < self.lora.num_slots

    def _follows_leader(self, req: Req, num_cached: int, leaders: list[Req]) -> bool:
        """True if a request already prefilling shares at least one uncached page with `req`."""
        seq = req.seq_ids()
        for leader in leaders:
            if leader.namespace == req.namespace:
                shared = common_prefix_len(seq, leader.seq_ids())
                if shared - num_cached >= self.page_size:
                    return True
        return False

    def _try_admit(
        self, req: Req, match: MatchResult, budget: int, reserved: int, busy: bool
    ) -> Work | None:
        """Locks the match and gives `req` pages for its first chunk, if the pool can hold
        it with what `reserved` promises the running requests; `busy`: some are running
        (a request alone in the batch is admitted whatever the estimate says)."""
        self.cache.lock(match.node)
        uncached = req.seq_len - match.num_tokens
        needed = self.pool.num_pages_for(uncached) + self._future_pages(req)
        available = self.pool.allocator.num_free + self._reclaimable_pages() - reserved
        if needed > available and busy:
            self.cache.unlock(match.node)
            return None
        num_in_pool = match.num_tokens
        match = self.pages.load_from_tier(match)  # tier pages count as pages needed above
        num_new = min(req.seq_len - match.num_tokens, budget)
        self.pages.attach(req, match)
        # alone, it must run: retention pins give way rather than leave it waiting forever
        if not self.pages.grow(req, num_new, unpin=not busy):
            self.pages.release(req)
            return None
        if req.num_retractions == 0:
            self._record_first_admission(req, match, num_in_pool)
        self.pages.release_hold(req)  # its own lock on the match keeps received pages now
        req.state = ReqState.RUNNING
        return Work(req, num_new)

    def _record_first_admission(self, req: Req, match: MatchResult, num_in_pool: int) -> None:
        """Queue time and cache hits are counted once per request, not per readmission."""
        req.queue_time = time.perf_counter() - req.arrival_time
        req.cached_tokens = match.num_tokens
        self.stats.cached_tokens += match.num_tokens
        req.cached_tokens_host = match.num_tokens - num_in_pool
        self.stats.cached_tokens_host += req.cached_tokens_host
        if match.num_tokens:
            self.cache.record_hit(match.node)

    # ---- page reservations ---------------------------------------------------------------

    def _reclaimable_pages(self) -> int:
        """Pages eviction may free for an admission: unpinned ones, and with pin_policy
        "last" also the pinned pages no running request holds."""
        if not self.pages.pins_give_way:
            return self.cache.num_evictable_pages()
        info = self.cache.size_info()
        return info.total_pages - info.protected_pages

    def _future_pages(self, req: Req) -> int:
        """Estimated pages a request will still need for output."""
        remaining = max(req.params.max_new_tokens - len(req.output_ids), 0)
        estimate = min(remaining, OUTPUT_ESTIMATE_CLIP) * self.ratio.value
        return int(estimate) // self.page_size + (1 if remaining else 0)

    def _reserved_pages(self, running: list[Req]) -> int:
        pending = sum(self.pool.num_pages_for(r.num_uncomputed) for r in running)
        return pending + sum(self._future_pages(r) for r in running)


def _put_first(first: list[Req], queue: deque[Req]) -> deque[Req]:
    """`queue` with `first` moved to its front (the requests an admission just made starved)."""
    if not first:
        return queue
    return deque([*first, *(r for r in queue if r not in first)])
