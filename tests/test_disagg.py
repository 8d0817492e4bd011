"""Prefill/decode disaggregation wired into the engine: two in-process cores (a prefill and a
decode worker) driven step by step, the bootstrap fields set by the test as sglang-router's PD
mode would. Pages must balance on both sides after normal, aborted and failed transfers."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
import time

import pytest
import torch

from conftest import greedy, make_core, prompt_ids
from radixserve.client.inproc_client import InProcessClient
from radixserve.client.request_builder import GenerateArgs, RequestBuilder
from radixserve.config import DisaggregationConfig, SchedulerConfig
from radixserve.engine import core_loop
from radixserve.engine.core_process import PipeTransport
from radixserve.engine.protocol import AbortRequests, Bootstrap, RequestSpec
from radixserve.engine.request import Req
from radixserve.engine.wire import encode
from radixserve.sampling.params import SamplingParams
from radixserve_bench.systems import free_port

PAGE = 16
HOST = "127.0.0.1"
PROMPT_LENGTHS = (40, 48, 10)  # partial last page, whole pages only, shorter than a page
_rooms = itertools.count(1000)

torch.set_num_threads(1)


def core(model, mode: str | None = None, **kwargs):
    flags = {"disaggregation_mode": mode or "null", "disaggregation_bootstrap_port": 0}
    return make_core(model, page_size=PAGE, **(flags | kwargs))


@pytest.fixture
def pd(tiny_chat_model):
    prefill = core(tiny_chat_model, "prefill", disaggregation_transfer_timeout=5.0)
    decode = core(tiny_chat_model, "decode", disaggregation_transfer_timeout=5.0)
    yield prefill, decode
    prefill.close()
    decode.close()


def request(ids, room: int | None = None, port: int | None = None, max_new_tokens=8) -> Req:
    bootstrap = None if room is None else Bootstrap(HOST, port, room)
    spec = RequestSpec(
        request_id=f"r{next(_rooms)}",
        rid="r",
        input_ids=list(ids),
        params=SamplingParams.from_dict(greedy(max_new_tokens)),
        seed=0,
        bootstrap=bootstrap,
    )
    return Req.from_spec(spec)


def run(cores, reqs, timeout_s: float = 30.0) -> None:
    """Steps every core until every request finished (the decode side's fetch runs on its
    own thread meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not all(r.finished for r in reqs):
        assert time.monotonic() < deadline, [r.state for r in reqs]
        progressed = False
        for c in cores:
            c.scheduler.step()
            progressed |= c.scheduler.last_step_progressed
        if not progressed:
            time.sleep(0.002)


def submit_pair(prefill, decode, ids, **kwargs) -> tuple[Req, Req]:
    """The same prompt to both sides under one fresh room."""
    room, port = next(_rooms), prefill.scheduler.handoff.bootstrap_port
    p, d = request(ids, room, port, **kwargs), request(ids, room, port, **kwargs)
    prefill.scheduler.add_request(p)
    decode.scheduler.add_request(d)
    return p, d


def assert_balanced(*cores) -> None:
    """No page leaked: the accounting holds, and flushing the tree frees every page."""
    for c in cores:
        assert not c.scheduler.has_work()
        c.check_integrity()
        assert c.flush_cache()
        allocator = c.runner.pool.allocator
        assert allocator.num_free == allocator.capacity


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


@pytest.mark.parametrize(
    ("config", "tp_size", "flag"),
    [
        (DisaggregationConfig(disaggregation_mode="both"), 1, "--disaggregation-mode"),
        (DisaggregationConfig(disaggregation_transfer_backend="nixl"), 1, "-transfer-backend"),
        (DisaggregationConfig(disaggregation_transfer_timeout=0), 1, "--disaggregation-transfer"),
        (DisaggregationConfig(disaggregation_bootstrap_port=70000), 1, "-bootstrap-port"),
        (DisaggregationConfig(disaggregation_mode="decode"), 2, "--tp-size"),
    ],
)
def test_bad_disaggregation_flags_are_refused_naming_the_flag(config, tp_size, flag):
    with pytest.raises(ValueError, match=flag):
        config.verify(SchedulerConfig(), tp_size)


def test_decode_without_the_radix_cache_is_refused_at_start():
    config = DisaggregationConfig(disaggregation_mode="decode")
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        config.verify(SchedulerConfig(disable_radix_cache=True), 1)
    DisaggregationConfig(disaggregation_mode="prefill").verify(SchedulerConfig(), 1)


def test_a_taken_bootstrap_port_is_refused_at_start(tiny_chat_model, pd):
    taken = pd[0].scheduler.handoff.bootstrap_port
    with pytest.raises(ValueError, match=f"--disaggregation-bootstrap-port {taken}"):
        core(tiny_chat_model, "prefill", disaggregation_bootstrap_port=taken)


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 200 + 1 for c in text]


def builder(mode: str | None) -> RequestBuilder:
    return RequestBuilder(_Tokenizer(), 256, 512, 4096, disaggregation_mode=mode)


BOOT = {"bootstrap_host": HOST, "bootstrap_port": 8998, "bootstrap_room": 5}


def test_bootstrap_fields_ride_on_the_request_spec():
    specs, _ = builder("decode").build(GenerateArgs(text="hi", **BOOT))
    assert specs[0].bootstrap == Bootstrap(HOST, 8998, 5)
    batch = GenerateArgs(text=["a", "b"], **(BOOT | {"bootstrap_room": [1, 2]}))
    specs, _ = builder("prefill").build(batch)
    assert [s.bootstrap.room for s in specs] == [1, 2]
    specs, _ = builder(None).build(GenerateArgs(text="hi"))
    assert specs[0].bootstrap is None


@pytest.mark.parametrize(
    ("mode", "fields", "message"),
    [
        (None, BOOT, "bootstrap_host needs a worker started with --disaggregation-mode"),
        ("decode", {"bootstrap_room": 5}, "bootstrap_host is missing"),
        ("decode", BOOT | {"bootstrap_host": ""}, "bootstrap_host must be"),
        ("decode", BOOT | {"bootstrap_port": "8998"}, "bootstrap_port must be"),
        ("decode", BOOT | {"bootstrap_port": 0}, "bootstrap_port must be"),
        ("decode", BOOT | {"bootstrap_room": -1}, "bootstrap_room must be"),
        ("decode", BOOT | {"bootstrap_room": 1 << 64}, "bootstrap_room must be"),
        ("decode", BOOT | {"bootstrap_room": True}, "bootstrap_room must be"),
        ("decode", BOOT | {"bootstrap_room": [1, 2]}, "bootstrap_room has 2 entries"),
    ],
)
def test_bad_bootstrap_fields_are_refused_naming_the_field(mode, fields, message):
    with pytest.raises(ValueError, match=message):
        builder(mode).build(GenerateArgs(text="hi", **fields))


def test_a_room_pairs_one_output_only():
    args = GenerateArgs(text="hi", sampling_params={"n": 2}, **BOOT)
    with pytest.raises(ValueError, match="n must be 1"):
        builder("decode").build(args)


# ---- arrival wakes an idle decode worker -------------------------------------------------


def spec(ids, room: int, port: int, max_new_tokens: int = 8) -> RequestSpec:
    params = SamplingParams.from_dict(greedy(max_new_tokens))
    boot = Bootstrap(HOST, port, room)
    return RequestSpec(f"r{room}", "r", list(ids), params, seed=0, bootstrap=boot)


def test_arrived_kv_wakes_an_idle_decode_core_at_once(tiny_chat_model, monkeypatch):
    # The back-off would now sleep 600 s: only the fetch's own wake-up can admit the request.
    monkeypatch.setattr(core_loop, "STALL_WAIT_MIN_S", 600.0)
    monkeypatch.setattr(core_loop, "STALL_WAIT_MAX_S", 600.0)
    prefill = core(tiny_chat_model, "prefill")
    decode = core(tiny_chat_model, "decode")
    num_steps = [0]
    step = decode.scheduler.step

    def counted_step():
        num_steps[0] += 1
        return step()

    monkeypatch.setattr(decode.scheduler, "step", counted_step)
    client = InProcessClient(decode)
    ids, room, port = prompt_ids(8, 40), next(_rooms), prefill.scheduler.handoff.bootstrap_port

    async def scenario() -> list[int]:
        tokens: list[int] = []
        async for out in client.generate(spec(ids, room, port)):
            tokens += out.new_token_ids
        return tokens

    async def main() -> tuple[list[int], int]:
        task = asyncio.create_task(scenario())
        while not decode.scheduler.receiving:  # parked; its step found nothing to do
            await asyncio.sleep(0.01)
        parked_at = num_steps[0]
        p = request(ids, room, port)
        prefill.scheduler.add_request(p)
        run([prefill], [p])  # publishes the room: the decode side's fetch completes
        return await asyncio.wait_for(task, timeout=30), parked_at

    try:
        tokens, parked_at = asyncio.run(main())
        assert len(tokens) == 8 and decode.get_stats()["kv_pages_received"] == 40 // PAGE
        # one step per token after the arrival: no step spent polling
        assert num_steps[0] - parked_at == 8
    finally:
        client.close()
        prefill.close()
        decode.close()


def test_a_pipe_transport_wakes_from_another_thread():
    ours, theirs = multiprocessing.Pipe()
    transport = PipeTransport(theirs)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(transport.receive(None)), daemon=True)
    waiter.start()
    threading.Timer(0.05, transport.wake).start()
    waiter.join(timeout=30)
    assert got == [[]]  # woken with no message
    transport.wake()
    transport.wake()  # wakes coalesce: one receive drains them
    assert transport.receive(None) == []
    ours.send_bytes(encode(AbortRequests(["x"])))
    assert transport.receive(None) == [AbortRequests(["x"])]


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
