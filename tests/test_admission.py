"""Admission on its own: which waiting requests join the batch, and the retraction victim."""

from __future__ import annotations

from conftest import SYSTEM, greedy, make_core, prompt_ids
from radixserve.engine.request import Req, ReqState
from radixserve.sampling.params import SamplingParams


def _req(rid: str, ids: list[int], max_new_tokens: int = 4) -> Req:
    return Req(rid, ids, SamplingParams(**greedy(max_new_tokens)), seed=0)


def test_admits_in_order_and_defers_a_follower_of_a_cold_shared_prefix(tiny_chat_model):
    core = make_core(tiny_chat_model)
    admission = core.scheduler.admission
    shared = SYSTEM[:96]
    leader, follower = _req("a", shared + prompt_ids(1, 8)), _req("b", shared + prompt_ids(2, 8))
    other = _req("c", prompt_ids(3, 40))
    waiting, running = [leader, follower, other], []
    work = admission.admit(waiting, running, budget=4096, leaders=[], retracted=set())
    assert [w.req.rid for w in work] == ["a", "c"]
    assert [w.num_new for w in work] == [104, 40]
    assert waiting == [follower] and running == [leader, other]
    assert leader.state is ReqState.RUNNING and follower.state is ReqState.WAITING


def test_a_request_retracted_in_this_step_is_not_admitted(tiny_chat_model):
    admission = make_core(tiny_chat_model).scheduler.admission
    req = _req("a", prompt_ids(0))
    waiting, running = [req], []
    assert admission.admit(waiting, running, budget=4096, leaders=[], retracted={req}) == []
    assert waiting == [req] and running == [] and req.state is ReqState.WAITING


def test_output_reserved_for_running_requests_holds_back_an_admission(tiny_chat_model):
    """A running request expected to decode far more than the pool holds leaves no room; a
    request alone in the batch is admitted whatever the estimate."""
    core = make_core(tiny_chat_model, max_total_tokens=640)
    admission = core.scheduler.admission
    busy = _req("busy", prompt_ids(0), max_new_tokens=4096)
    busy.num_computed = busy.seq_len
    req = _req("new", prompt_ids(1))
    waiting = [req]
    assert admission.admit(waiting, [busy], budget=4096, leaders=[], retracted=set()) == []
    assert waiting == [req] and req.state is ReqState.WAITING
    running: list[Req] = []
    work = admission.admit(waiting, running, budget=4096, leaders=[], retracted=set())
    assert [w.req for w in work] == [req] and running == [req]


def test_the_retraction_victim_holds_most_own_pages_lowest_priority_first(tiny_chat_model):
    small, big, low = (_req(rid, prompt_ids(i)) for i, rid in enumerate(["small", "big", "low"]))
    small.page_table, big.page_table, low.page_table = [1], [2, 3, 4], [5]
    low.priority = -1
    plain = make_core(tiny_chat_model).scheduler.admission
    assert plain.retraction_victim([small, big, low]) is big
    by_priority = make_core(tiny_chat_model, enable_priority_scheduling=True).scheduler.admission
    assert by_priority.retraction_victim([small, big, low]) is low


def test_common_prefix_len_counts_the_shared_leading_ids():
    from radixserve.token_ids import common_prefix_len

    assert common_prefix_len([], [1, 2]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_len([1, 2, 3], [1, 2]) == 2
    assert common_prefix_len([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_len([7], [1]) == 0
