"""Prefill/decode disaggregation wired into the engine: two in-process cores (a prefill and a
decode worker) driven step by step, the bootstrap fields set by the test as sglang-router's PD
mode would. The decode side continues from the prefill side's KV exactly; pages balance on
both sides after normal, aborted and failed transfers, and received pages are held until
their request is admitted."""

from __future__ import annotations

import pytest
from disagg_cores import PAGE, assert_balanced, core, request, run, submit_pair

from conftest import prompt_ids
from radixserve.engine.request import Req
from radixserve_bench.systems import free_port

PROMPT_LENGTHS = (40, 48, 10)  # partial last page, whole pages only, shorter than a page


@pytest.fixture
def pd(tiny_chat_model):
    prefill = core(tiny_chat_model, "prefill", disaggregation_transfer_timeout=5.0)
    decode = core(tiny_chat_model, "decode", disaggregation_transfer_timeout=5.0)
    yield prefill, decode
    prefill.close()
    decode.close()


def test_decode_continues_from_the_prefill_workers_kv_exactly(tiny_chat_model, pd):
    prefill, decode = pd
    prompts = [prompt_ids(i, n) for i, n in enumerate(PROMPT_LENGTHS)]
    single = core(tiny_chat_model)
    alone = [request(ids) for ids in prompts]
    for r in alone:
        single.scheduler.add_request(r)
    run([single], alone)
    pairs = [submit_pair(prefill, decode, ids) for ids in prompts]
    run([prefill, decode], [r for pair in pairs for r in pair])
    for (p, d), ref, ids in zip(pairs, alone, prompts):
        assert d.finish_reason.kind == "length" and d.output_ids == ref.output_ids
        assert len(p.output_ids) == 1  # the prefill side returns after the prompt
        # admitted as a hit of the whole pages before the last token: computed only the rest
        assert d.cached_tokens == (len(ids) - 1) // PAGE * PAGE
    whole_pages = sum(len(ids) // PAGE for ids in prompts)
    assert prefill.get_stats()["kv_pages_sent"] == whole_pages
    assert decode.get_stats()["kv_pages_received"] == whole_pages
    assert decode.get_stats()["kv_bytes_received"] == prefill.get_stats()["kv_bytes_sent"] > 0
    # the received pages live in the decode side's tree: a follow-up turn hits them
    follow = request(prompts[0] + pairs[0][1].output_ids + [7, 8, 9])
    decode.scheduler.add_request(follow)
    run([decode], [follow])
    computed = len(prompts[0]) + 8 - 1  # the decode's last token had no KV computed
    assert follow.cached_tokens == computed // PAGE * PAGE
    assert_balanced(prefill, decode, single)


def test_a_dead_or_silent_prefill_side_fails_the_request_naming_its_room(tiny_chat_model):
    decode = core(tiny_chat_model, "decode", disaggregation_transfer_timeout=0.5)
    silent = core(tiny_chat_model, "prefill", disaggregation_transfer_timeout=0.3)
    try:
        unreachable = request(prompt_ids(1, 40), room=11, port=free_port())
        never_published = request(prompt_ids(2, 40), 12, silent.scheduler.handoff.bootstrap_port)
        for r in (unreachable, never_published):
            decode.scheduler.add_request(r)
        run([decode, silent], [unreachable, never_published])
        for r, room in ((unreachable, 11), (never_published, 12)):
            assert r.finish_reason.is_abort and f"bootstrap_room {room}" in r.finish_reason.message
            assert r.output_ids == []
        assert decode.get_stats()["kv_transfer_failures"] == 2
        assert_balanced(decode, silent)
    finally:
        decode.close()
        silent.close()


def test_a_prefill_worker_stopped_mid_run_fails_the_decode_cleanly(tiny_chat_model, pd):
    prefill, decode = pd
    p, d = submit_pair(prefill, decode, prompt_ids(3, 40))
    for _ in range(3):
        decode.scheduler.step()  # the decode side waits for the room; prefill never runs
    prefill.close()  # its bootstrap server goes away with the room unpublished
    run([decode], [d])
    assert d.finish_reason.is_abort and "bootstrap_room" in d.finish_reason.message
    prefill.scheduler.abort_request(p.request_id)
    run([prefill], [p])
    assert_balanced(prefill, decode)


def test_aborts_on_either_side_leave_no_page_behind(pd):
    prefill, decode = pd
    # decode aborted while its KV is on the way
    p1, d1 = submit_pair(prefill, decode, prompt_ids(4, 40))
    decode.scheduler.step()
    assert d1 in decode.scheduler.receiving
    decode.scheduler.abort_request(d1.request_id)
    run([prefill, decode], [p1, d1])
    assert d1.finish_reason.is_abort and p1.finish_reason.kind == "length"
    # prefill aborted before it computed: the decode side hears of it at once (no timeout)
    p2, d2 = submit_pair(prefill, decode, prompt_ids(5, 40))
    prefill.scheduler.abort_request(p2.request_id)
    run([prefill, decode], [p2, d2], timeout_s=4.0)  # the transfer timeout is 5 s
    assert p2.finish_reason.is_abort
    room = d2.bootstrap.room  # the client hears one message; the reason is in the log
    assert d2.finish_reason.is_abort
    assert d2.finish_reason.message == f"KV transfer for bootstrap_room {room} failed"
    assert_balanced(prefill, decode)


def test_fake_backend_moves_nothing_and_the_decode_side_computes_the_prompt(tiny_chat_model):
    fake = {"disaggregation_transfer_backend": "fake"}
    prefill = core(tiny_chat_model, "prefill", **fake)
    decode = core(tiny_chat_model, "decode", **fake)
    single = core(tiny_chat_model)
    try:
        assert prefill.scheduler.handoff.bootstrap_port is None  # nothing listens
        ids = prompt_ids(6, 40)
        p, d = request(ids, 21, 1), request(ids, 21, 1)
        ref = request(ids)
        prefill.scheduler.add_request(p)
        decode.scheduler.add_request(d)
        single.scheduler.add_request(ref)
        run([prefill, decode, single], [p, d, ref])
        assert d.output_ids == ref.output_ids and d.cached_tokens == 0
        assert len(p.output_ids) == 1
        assert prefill.get_stats()["kv_pages_sent"] == 0
        assert decode.get_stats()["kv_pages_received"] == 0
        assert_balanced(prefill, decode, single)
    finally:
        prefill.close()
        decode.close()


def test_requests_without_a_room_run_as_on_a_normal_worker(pd):
    prefill, decode = pd
    p, d = request(prompt_ids(7, 40)), request(prompt_ids(7, 40))
    prefill.scheduler.add_request(p)
    decode.scheduler.add_request(d)
    run([prefill, decode], [p, d])
    assert len(p.output_ids) == 1 and len(d.output_ids) == 8
    assert prefill.get_stats()["kv_pages_sent"] == 0
    assert_balanced(prefill, decode)


def test_a_taken_bootstrap_port_is_refused_at_start(tiny_chat_model, pd):
    taken = pd[0].scheduler.handoff.bootstrap_port
    with pytest.raises(ValueError, match=f"--disaggregation-bootstrap-port {taken}"):
        core(tiny_chat_model, "prefill", disaggregation_bootstrap_port=taken)


# ---- received pages are held until admission ---------------------------------------------

TINY_POOL = {"max_total_tokens": 12 * PAGE, "schedule_policy": "fcfs", "max_running_requests": 1}


@pytest.fixture
def tiny_decode(tiny_chat_model):
    decode = core(tiny_chat_model, "decode", disaggregation_transfer_timeout=5.0, **TINY_POOL)
    assert decode.runner.pool.allocator.capacity == 12
    yield decode
    decode.close()


def receive_behind(prefill, decode, blockers: list[Req], ids, **kwargs) -> tuple[Req, Req]:
    """A PD pair whose decode side is stored (its pages held) but queued behind `blockers`."""
    for r in blockers:
        decode.scheduler.add_request(r)
    p, d = submit_pair(prefill, decode, ids, **kwargs)
    run([prefill], [p])
    decode.scheduler.step()  # a blocker is admitted, d's fetch starts
    while d.kv_future is not None:
        d.kv_future.exception(timeout=5)  # arrived: the next step stores it
        decode.scheduler.step()
    assert d in decode.scheduler.waiting
    return p, d


def test_received_pages_survive_churn_until_admission(pd, tiny_decode):
    prefill, decode = pd[0], tiny_decode
    churn = [request(prompt_ids(20 + i, 64)) for i in range(4)]  # 4 pages each into the tree
    _, d = receive_behind(prefill, decode, churn, prompt_ids(9, 40))
    run([decode], [*churn, d])
    assert decode.get_stats()["evicted_pages"] > 0  # the churn did push pages out
    assert d.cached_tokens == 32 and d.num_retractions == 0  # both received pages hit
    assert_balanced(decode)


def test_holds_give_way_before_a_running_request_is_retracted(pd, tiny_decode):
    prefill, decode = pd[0], tiny_decode
    # grows to 9 pages: more than the 12 - 4 held leave; the newest hold must give way
    long = request(prompt_ids(30, 64), max_new_tokens=70)
    _, first = receive_behind(prefill, decode, [long], prompt_ids(10, 40))
    _, second = receive_behind(prefill, decode, [], prompt_ids(11, 40))
    run([decode], [long, first, second])
    assert long.num_retractions == 0 and len(long.output_ids) == 70
    assert first.cached_tokens == 32 and second.cached_tokens == 0
    assert_balanced(decode)


def test_aborted_waiting_requests_release_their_holds(pd, tiny_decode):
    prefill, decode = pd[0], tiny_decode
    long = request(prompt_ids(31, 64), max_new_tokens=4)
    _, d = receive_behind(prefill, decode, [long], prompt_ids(12, 40))
    assert decode.scheduler.pages.holds
    decode.scheduler.abort_request(d.request_id)
    run([decode], [long, d])
    assert d.finish_reason.is_abort and not decode.scheduler.pages.holds
    _, d2 = receive_behind(prefill, decode, [request(prompt_ids(32, 64))], prompt_ids(13, 40))
    decode.scheduler.abort_all("test")
    assert d2.finish_reason.is_abort and not decode.scheduler.pages.holds
    assert_balanced(decode)
