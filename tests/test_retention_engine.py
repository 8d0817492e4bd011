"""Retention, pins and priorities through the engine: sessions that survive a flood, the
pinned-fraction bound, no deadlock behind pins, priority order with aging."""

from __future__ import annotations

import pytest

from conftest import greedy, make_core, make_engine, prompt_ids
from radixserve.cache.retention import prefix_pin_key, session_pin_key
from radixserve.engine.protocol import PinRequest
from radixserve.engine.request import Req
from radixserve.sampling.params import SamplingParams

POOL = {"max_total_tokens": 640, "page_size": 16}  # 40 pages


def _session_turns(engine, retention, num_flood: int = 12) -> int:
    """Turn 1 of a session, a flood of one-off prompts, then turn 2: its cached tokens."""
    history = prompt_ids(1, 160)
    first = engine.generate(
        input_ids=history, sampling_params=greedy(16), session_id="s", retention=retention
    )
    for i in range(num_flood):
        engine.generate(input_ids=prompt_ids(100 + i, 96), sampling_params=greedy(8))
    resumed = history + first["output_ids"] + prompt_ids(7, 16)
    second = engine.generate(input_ids=resumed, sampling_params=greedy(4), session_id="s")
    return second["meta_info"]["cached_tokens"]


def test_a_paused_session_survives_a_flood_that_evicts_it_without_retention(tiny_chat_model):
    with make_engine(tiny_chat_model, **POOL) as engine:
        assert _session_turns(engine, retention=None) == 0
        engine.flush_cache()
        # 175 tokens computed (the last output has no KV yet): 10 whole pages kept
        assert _session_turns(engine, retention={"ttl_s": 60}) == 160
        assert engine.get_stats()["num_pins"] == 0  # turn 2 ended the pin (it asked for none)
        engine.check_integrity()


def test_an_expired_retention_no_longer_protects(tiny_chat_model):
    core = make_core(tiny_chat_model, **POOL)
    sched = core.scheduler
    clock = [0.0]
    sched.pins.clock = lambda: clock[0]
    _run(sched, [_req("s1", prompt_ids(1, 64), pin=PinRequest(session_pin_key("s"), 5.0))])
    assert len(sched.pins) == 1
    clock[0] = 6.0
    _run(sched, [_req("x", prompt_ids(2, 16))])  # any step expires it
    assert len(sched.pins) == 0 and core.cache.num_pinned_pages() == 0
    core.check_integrity()


def test_pinned_fraction_bound_holds_under_a_flood_of_pinning_sessions(tiny_chat_model):
    core = make_core(tiny_chat_model, max_pinned_fraction=0.3, **POOL)
    sched = core.scheduler
    bound = sched.pins.max_pinned_pages
    assert bound == int(0.3 * sched.pool.allocator.capacity)
    reqs = [
        _req(f"s{i}", prompt_ids(i, 64), pin=PinRequest(session_pin_key(f"s{i}"), 600.0))
        for i in range(30)
    ]
    for req in reqs:
        sched.add_request(req)
    for _ in range(2000):
        if not sched.has_work():
            break
        sched.step()
        assert core.cache.num_pinned_pages() <= bound
        core.check_integrity()
    assert all(r.finished and not r.finish_reason.is_abort for r in reqs)
    assert 0 < len(sched.pins) < 30 and sched.pins.num_degraded > 0


def test_pins_holding_the_whole_pool_give_way_instead_of_deadlocking(tiny_chat_model):
    core = make_core(tiny_chat_model, max_pinned_fraction=1.0, **POOL)
    sched = core.scheduler
    for i in range(4):  # 4 x 9 pages pinned: 36 of 40
        _run(sched, [_req(f"p{i}", prompt_ids(i, 144), pin=PinRequest(prefix_pin_key(str(i))))])
    assert core.cache.num_pinned_pages() == 36
    big = _req("big", prompt_ids(9, 300), max_new_tokens=8)
    _run(sched, [big], max_steps=200)
    assert big.finished and len(big.output_ids) == 8
    assert sched.pins.num_degraded > 0
    core.check_integrity()


def test_higher_priority_is_admitted_first(tiny_chat_model):
    core = make_core(tiny_chat_model, enable_priority_scheduling=True, max_running_requests=1)
    low = _req("low", prompt_ids(1, 32), priority=0)
    high = _req("high", prompt_ids(2, 32), priority=5)
    finished = _run(core.scheduler, [low, high])
    assert finished == ["high", "low"]


def test_aging_lets_low_priority_through_a_stream_of_high_priority(tiny_chat_model):
    core = make_core(
        tiny_chat_model,
        enable_priority_scheduling=True,
        max_running_requests=1,
        schedule_max_bypass=3,
        schedule_policy="fcfs",
    )
    sched = core.scheduler
    low = _req("low", prompt_ids(0, 32), priority=-1, max_new_tokens=2)
    sched.add_request(low)
    highs = [_req(f"h{i}", prompt_ids(i + 1, 32), priority=9, max_new_tokens=2) for i in range(8)]
    order: list[str] = []
    for high in highs:  # a new high-priority request arrives every step
        sched.add_request(high)
        order += [r.rid for r in sched.step() if r.finished]
    order += _run(sched, [])
    assert order.index("low") <= 4  # passed over by at most schedule_max_bypass newer ones


def test_priority_orders_retraction_lowest_first(tiny_chat_model):
    core = make_core(tiny_chat_model, enable_priority_scheduling=True, **POOL)
    sched = core.scheduler
    reqs = [_req(f"r{i}", prompt_ids(i, 24), priority=i % 3, max_new_tokens=120) for i in range(9)]
    for req in reqs:
        sched.add_request(req)
    retracted: list[int] = []
    while sched.has_work():
        before = {r: r.num_retractions for r in reqs}
        running = [r.priority for r in sched.running]
        sched.step()
        retracted += [r.priority for r in reqs if r.num_retractions > before[r]]
        if retracted:
            assert min(running) == retracted[0]
            break
    assert retracted, "the pool was meant to run short"


def test_priority_without_the_flag_is_refused(tiny_chat_model):
    with make_engine(tiny_chat_model) as engine:
        with pytest.raises(ValueError, match="enable-priority-scheduling"):
            engine.generate(input_ids=[1, 2, 3], sampling_params=greedy(1), priority=3)
        engine.generate(input_ids=[1, 2, 3], sampling_params=greedy(1), priority=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"retention": {"ttl_s": 5}}, "needs a session_id"),
        ({"session_id": "", "retention": {"ttl_s": 5}}, "session_id must be"),
        ({"session_id": "s", "retention": {"ttl_s": 0}}, "ttl_s must be > 0"),
        ({"session_id": "s", "retention": {"ttl_s": True}}, "ttl_s must be a number"),
        ({"session_id": "s", "retention": {"ttl": 5}}, "retention must be an object"),
        ({"session_id": "s", "retention": 5}, "retention must be an object"),
    ],
)
def test_bad_retention_fields_are_refused(tiny_chat_model, kwargs, message):
    with make_engine(tiny_chat_model) as engine:
        with pytest.raises(ValueError, match=message):
            engine.generate(input_ids=[1, 2, 3], sampling_params=greedy(1), **kwargs)


def _req(rid, ids, pin=None, priority=0, max_new_tokens=4) -> Req:
    params = SamplingParams(**greedy(max_new_tokens))
    return Req(rid, ids, params, seed=0, pin=pin, priority=priority)


def _run(sched, reqs: list[Req], max_steps: int = 5000) -> list[str]:
    """Steps until idle; the rids of requests in the order they finished."""
    for req in reqs:
        sched.add_request(req)
    finished: list[str] = []
    for _ in range(max_steps):
        if not sched.has_work():
            return finished
        finished += [r.rid for r in sched.step() if r.finished]
    raise AssertionError(f"still busy after {max_steps} steps: a deadlock?")


def _pin_two_sessions_then_run_beside_a_long_request(pin_policy: str, tiny_chat_model):
    """Two pinned sessions (18 pages), a long request running (holding pages), and a new
    request that fits only if pins give way. Returns (the scheduler, the new request)."""
    core = make_core(tiny_chat_model, max_pinned_fraction=0.5, pin_policy=pin_policy, **POOL)
    sched = core.scheduler
    for i in range(2):
        _run(sched, [_req(f"s{i}", prompt_ids(i, 144), pin=PinRequest(session_pin_key(str(i))))])
    runner = _req("runner", prompt_ids(5, 96), max_new_tokens=200)
    sched.add_request(runner)
    sched.step()
    late = _req("late", prompt_ids(6, 160), max_new_tokens=2)
    sched.add_request(late)
    for _ in range(3):
        sched.step()
    return core, late


def test_pin_policy_hard_keeps_pins_while_a_request_waits(tiny_chat_model):
    core, late = _pin_two_sessions_then_run_beside_a_long_request("hard", tiny_chat_model)
    assert late.state.value == "waiting" and len(core.scheduler.pins) == 2
    _run(core.scheduler, [])  # the runner finishes, then the late request fits
    assert late.finished
    core.check_integrity()


def test_pin_policy_last_lets_pins_yield_to_admission(tiny_chat_model):
    core, late = _pin_two_sessions_then_run_beside_a_long_request("last", tiny_chat_model)
    assert late.state.value != "waiting"  # the pinned pages counted as reclaimable
    _run(core.scheduler, [])
    core.check_integrity()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pin_policy": "soft"}, "pin_policy must be one of"),
        ({"max_pinned_fraction": 1.5}, "in \\[0, 1\\]"),
    ],
)
def test_bad_retention_flags_are_refused(kwargs, message):
    from radixserve.config import SchedulerConfig

    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs).verify()
