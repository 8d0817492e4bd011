"""Queue policies: lpm order, dfs-weight order, and lpm's bounded wait for cold requests."""

from __future__ import annotations

import pytest

from conftest import make_engine, prompt_ids
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.engine.policy import order_waiting
from radixserve.engine.request import Req, ReqState
from radixserve.sampling.params import SamplingParams

PS = 4


def _req(rid: str, ids: list[int], wait_steps: int = 0, namespace: str | None = None) -> Req:
    req = Req(rid=rid, input_ids=ids, params=SamplingParams(), seed=0, namespace=namespace)
    req.wait_steps = wait_steps
    return req


def _cache_with(*sequences: list[int]) -> RadixCache:
    alloc = PageAllocator(256)
    cache = RadixCache(alloc, PS)
    for seq in sequences:
        cache.insert(seq, alloc.allocate(len(seq) // PS).tolist())
    return cache


def _order(cache, reqs, policy, max_wait=100):
    matches = {r: cache.match_prefix(r.input_ids, r.namespace) for r in reqs}
    return [r.rid for r in order_waiting(reqs, policy, matches, max_wait, cache.parent_of)]


A = list(range(100, 132))  # 32 tokens cached
B = list(range(200, 216))  # 16 tokens cached


def test_lpm_orders_by_cached_length_and_fcfs_by_arrival():
    cache = _cache_with(A, B)
    reqs = [_req("cold", [1] * 20), _req("b", B + [5, 6]), _req("a", A + [7, 8])]
    assert _order(cache, reqs, "lpm") == ["a", "b", "cold"]
    assert _order(cache, reqs, "fcfs") == ["cold", "b", "a"]


def test_starved_requests_go_first_under_every_policy():
    cache = _cache_with(A)
    reqs = [_req("hot", A + [1]), _req("cold", [9] * 20, wait_steps=100)]
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


def _steps_until_cold_runs(engine, max_steps: int) -> int | None:
    hot_prefix = prompt_ids(0, 64)
    engine.generate(input_ids=hot_prefix + [1], sampling_params={"max_new_tokens": 1})
    hot_params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    cold = Req(rid="cold", input_ids=prompt_ids(99, 40), params=hot_params, seed=0)
    sched = engine.scheduler
    sched.add_request(cold)
    for step in range(max_steps):
        for i in range(2):  # hot requests keep arriving faster than they finish
            ids = hot_prefix + [step, i]
            sched.add_request(Req(rid=f"hot-{step}-{i}", input_ids=ids, params=hot_params, seed=0))
        sched.step()
        if cold.state is not ReqState.WAITING:
            return step
    return None


@pytest.mark.parametrize("max_wait", [4, 10])
def test_lpm_never_starves_a_cold_request(tiny_chat_model, max_wait):
    engine = make_engine(tiny_chat_model, max_running_requests=2, schedule_max_wait_steps=max_wait)
    step = _steps_until_cold_runs(engine, 60)
    assert step is not None and step <= max_wait + 3  # +3: a running slot must free up first


def test_without_aging_lpm_starves_the_cold_request(tiny_chat_model):
    engine = make_engine(tiny_chat_model, max_running_requests=2, schedule_max_wait_steps=10**9)
    assert _steps_until_cold_runs(engine, 40) is None  # what the aging bound prevents
