"""Queue policies: lpm order, dfs-weight order, and lpm's bounded wait for cold requests."""

from __future__ import annotations

import pytest

from conftest import make_core, prompt_ids
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import MatchResult
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import SchedulerConfig
from radixserve.engine.policy import Aging, match_score, order_waiting
from radixserve.engine.request import Req, ReqState
from radixserve.sampling.params import SamplingParams

PS = 4


def _req(rid: str, ids: list[int], num_bypassed: int = 0, namespace: str | None = None) -> Req:
    req = Req(rid=rid, input_ids=ids, params=SamplingParams(), seed=0, namespace=namespace)
    req.num_bypassed = num_bypassed
    return req


def _cache_with(*sequences: list[int]) -> RadixCache:
    alloc = PageAllocator(256)
    cache = RadixCache(alloc, PS)
    for seq in sequences:
        cache.insert(seq, alloc.allocate(len(seq) // PS).tolist())
    return cache


def _order(cache, reqs, policy, max_bypass=100):
    matches = {r: cache.match_prefix(r.input_ids, r.namespace) for r in reqs}
    return [r.rid for r in order_waiting(reqs, policy, matches, max_bypass, cache.parent_of)]


A = list(range(100, 132))  # 32 tokens cached
B = list(range(200, 216))  # 16 tokens cached


def test_lpm_orders_by_cached_length_and_fcfs_by_arrival():
    cache = _cache_with(A, B)
    reqs = [_req("cold", [1] * 20), _req("b", B + [5, 6]), _req("a", A + [7, 8])]
    assert _order(cache, reqs, "lpm") == ["a", "b", "cold"]
    assert _order(cache, reqs, "fcfs") == ["cold", "b", "a"]


def test_starved_requests_go_first_under_every_policy():
    cache = _cache_with(A)
    reqs = [_req("hot", A + [1]), _req("cold", [9] * 20, num_bypassed=100)]
    for policy in ("lpm", "dfs-weight", "fcfs"):
        assert _order(cache, reqs, policy)[0] == "cold"


def test_dfs_weight_visits_heavier_subtrees_first():
    shared = A[:16]
    light = shared + list(range(300, 316))
    heavy = shared + list(range(400, 416))
    cache = _cache_with(light, heavy)
    reqs = [
        _req("light", light + [1]),
        _req("heavy1", heavy + [2]),
        _req("other", [7] * 20),
        _req("heavy2", heavy + [3]),
    ]
    order = _order(cache, reqs, "dfs-weight")
    assert order.index("heavy1") < order.index("light")
    assert order.index("heavy2") < order.index("light")
    assert abs(order.index("heavy1") - order.index("heavy2")) == 1  # siblings run together


def test_dfs_weight_groups_an_unseen_namespace_apart_from_unsalted_requests():
    """Salted requests whose namespace has no tree yet share that namespace's own root."""
    cache = _cache_with(A)
    reqs = [
        _req("plain1", [1] * 20),
        _req("salted1", [2] * 20, namespace="salt"),
        _req("plain2", [3] * 20),
        _req("salted2", [4] * 20, namespace="salt"),
    ]
    order = _order(cache, reqs, "dfs-weight")
    assert abs(order.index("salted1") - order.index("salted2")) == 1
    assert abs(order.index("plain1") - order.index("plain2")) == 1


def test_aging_counts_only_later_arrivals_admitted_ahead():
    old, cold, new = _req("old", [1]), _req("cold", [2], num_bypassed=1), _req("new", [3])
    for arrival, req in enumerate((old, cold, new)):
        req.arrival_time = float(arrival)
    aging = Aging([old, cold, new], max_bypass=3)
    assert aging.admit(old) == []  # arrived first: bypasses nobody
    old.state = ReqState.RUNNING
    assert aging.admit(new) == []
    new.state = ReqState.RUNNING
    assert aging.num_bypassed(cold) == 2
    late = _req("late", [4])
    late.arrival_time = 3.0
    assert aging.admit(late) == [cold]  # the third bypass: cold goes next, still in this step
    aging.commit([cold])
    assert cold.num_bypassed == 3


HOT_PREFIX = prompt_ids(0, 64)


def greedy_params(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


HOT_PARAMS = greedy_params(2)


def _engine_with_hot_prefix(tiny_chat_model, **kwargs):
    """A core whose radix tree holds HOT_PREFIX; the tests step its scheduler themselves."""
    core = make_core(tiny_chat_model, **kwargs)
    core.scheduler.add_request(_hot("warm", [1]))
    while core.scheduler.has_work():
        core.scheduler.step()
    return core


def _hot(rid: str, suffix: list[int]) -> Req:
    return Req(rid=rid, input_ids=HOT_PREFIX + suffix, params=HOT_PARAMS, seed=0)


def _cold(rid: str, i: int) -> Req:
    return Req(rid=rid, input_ids=prompt_ids(i, 40), params=HOT_PARAMS, seed=0)


def _run_cold_under_hot_stream(engine, max_steps: int) -> Req:
    """A cold request, then two hot ones each step (they arrive faster than they finish)."""
    cold = _cold("cold", 99)
    sched = engine.scheduler
    sched.add_request(cold)
    for step in range(max_steps):
        for i in range(2):
            sched.add_request(_hot(f"hot-{step}-{i}", [step, i]))
        sched.step()
        if cold.state is not ReqState.WAITING:
            break
    return cold


@pytest.mark.parametrize("max_bypass", [4, 10])
def test_lpm_admits_a_cold_request_after_at_most_max_bypass_newer_ones(tiny_chat_model, max_bypass):
    engine = _engine_with_hot_prefix(
        tiny_chat_model, max_running_requests=2, schedule_max_bypass=max_bypass
    )
    cold = _run_cold_under_hot_stream(engine, 60)
    assert cold.state is not ReqState.WAITING
    assert cold.num_bypassed == max_bypass  # lpm passed it over exactly as often as allowed


def test_without_aging_lpm_starves_the_cold_request(tiny_chat_model):
    engine = _engine_with_hot_prefix(
        tiny_chat_model, max_running_requests=2, schedule_max_bypass=10**9
    )
    cold = _run_cold_under_hot_stream(engine, 40)
    assert cold.state is ReqState.WAITING  # what the aging bound prevents


def test_lpm_keeps_its_order_when_every_request_has_waited_long(tiny_chat_model):
    """Under sustained load every request waits many steps; lpm must not turn into fcfs:
    hot requests still go first, until the cold ones have been passed over max_bypass times."""
    engine = _engine_with_hot_prefix(tiny_chat_model, max_running_requests=1, schedule_max_bypass=3)
    sched = engine.scheduler
    blocker = Req(rid="blocker", input_ids=prompt_ids(50, 20), params=greedy_params(30), seed=0)
    sched.add_request(blocker)
    sched.step()
    waiting = [_cold("cold0", 98), _cold("cold1", 97)] + [_hot(f"hot{i}", [i]) for i in range(5)]
    for req in waiting:
        sched.add_request(req)
    admitted: list[str] = []
    for _ in range(200):
        sched.step()
        admitted += [
            r.rid for r in waiting if r.state is not ReqState.WAITING and r.rid not in admitted
        ]
        if not sched.has_work():
            break
    assert blocker.finished and len(blocker.output_ids) == 30  # everyone waited > 16 steps
    assert admitted == ["hot0", "hot1", "hot2", "cold0", "cold1", "hot3", "hot4"]


def test_priority_orders_before_the_policy_and_starved_requests_still_go_first():
    cache = _cache_with(A)
    hot = _req("hot", A + [1, 2, 3, 4])
    cold_high = _req("cold_high", [9] * 8)
    cold_high.priority = 5
    starved_low = _req("starved_low", [7] * 8, num_bypassed=100)
    starved_low.priority = -3
    reqs = [hot, cold_high, starved_low]
    matches = {r: cache.match_prefix(r.input_ids) for r in reqs}
    plain = order_waiting(reqs, "lpm", matches, 100, cache.parent_of)
    ranked = order_waiting(reqs, "lpm", matches, 100, cache.parent_of, by_priority=True)
    assert [r.rid for r in plain] == ["starved_low", "hot", "cold_high"]
    assert [r.rid for r in ranked] == ["starved_low", "cold_high", "hot"]


def test_lpm_counts_a_tier_match_at_its_weight():
    pool_hit, tier_hit = _req("pool", A[:16] + [1]), _req("tier", B + [2])
    root = object()
    matches = {
        pool_hit: MatchResult(pages=[0] * 4, num_tokens=16, node=root),
        tier_hit: MatchResult(pages=[], num_tokens=0, node=root, host_tokens=32, host_node=root),
    }
    reqs = [pool_hit, tier_hit]

    def lpm(weight: float) -> list[str]:
        ordered = order_waiting(reqs, "lpm", matches, 100, lambda n: None, tier_weight=weight)
        return [r.rid for r in ordered]

    assert lpm(0.0) == ["pool", "tier"]  # pool hits only
    assert lpm(0.4) == ["pool", "tier"]  # 12.8 < 16
    assert lpm(0.9) == ["tier", "pool"]  # 28.8 > 16
    assert match_score(matches[tier_hit], 0.5) == 16


def test_dfs_weight_places_a_tier_match_at_its_tier_node():
    shared = A[:16]
    light, heavy = shared + list(range(300, 316)), shared + list(range(400, 416))
    cache = _cache_with(light, heavy)
    reqs = [_req("light", light + [1]), _req("tiered", heavy + [2]), _req("heavy", heavy + [3])]
    matches = {r: cache.match_prefix(r.input_ids) for r in reqs}
    # "tiered" found its heavy suffix in the tier only: its pool match ends at `shared`
    heavy_node = matches[reqs[1]].node
    matches[reqs[1]] = MatchResult(
        pages=[],
        num_tokens=16,
        node=cache.parent_of(heavy_node),
        host_tokens=16,
        host_node=heavy_node,
    )

    def dfs(weight: float) -> list[str]:
        ordered = order_waiting(
            reqs, "dfs-weight", matches, 100, cache.parent_of, tier_weight=weight
        )
        return [r.rid for r in ordered]

    assert dfs(0.0)[0] == "tiered"  # at the shared node, visited before its children
    assert dfs(0.9) in (["tiered", "heavy", "light"], ["heavy", "tiered", "light"])


@pytest.mark.parametrize("weight", [-0.1, 1.5])
def test_a_tier_match_weight_outside_0_1_is_refused(weight):
    with pytest.raises(ValueError, match="schedule_tier_match_weight"):
        SchedulerConfig(schedule_tier_match_weight=weight).verify()
