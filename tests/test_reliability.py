"""Faults in the engine, through the public Engine API: one failing request never takes the
batch down, a failing step aborts only its requests, the core waits instead of spinning, and
requests are routed by their internal id, never by the caller's rid."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future

import pytest

from conftest import greedy, make_engine, prompt_ids
from radixserve.client.client import EngineClient, EngineDeadError
from radixserve.engine import core_loop
from radixserve.engine.faults import ENV_VAR
from radixserve.engine.protocol import RequestSpec
from radixserve.sampling.grammar import GrammarBackend
from radixserve.sampling.params import SamplingParams


def faulty_engine(model, monkeypatch, *points: str, **kwargs):
    monkeypatch.setenv(ENV_VAR, json.dumps({"rid_prefix": "fault-", "points": list(points)}))
    return make_engine(model, **kwargs)


def run_batch(engine, rids: list[str], **params):
    prompts = [prompt_ids(i) for i in range(len(rids))]
    return engine.generate(input_ids=prompts, sampling_params=greedy(8, **params), rid=rids)


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    """The outputs of the same three prompts on a healthy engine."""
    engine = make_engine(tiny_chat_model)
    outputs = run_batch(engine, ["a", "b", "c"])
    engine.shutdown()
    return [o["output_ids"] for o in outputs]


def assert_healthy(engine, reference):
    """The engine still serves, gives the healthy outputs, and has leaked no page."""
    outputs = run_batch(engine, ["x", "y", "z"])
    assert [o["output_ids"] for o in outputs] == reference
    engine.check_integrity()
    stats = engine.get_stats()
    assert stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0
    assert engine.flush_cache()
    assert stats["pool_capacity_pages"] == engine.get_stats()["pool_free_pages"]


@pytest.mark.parametrize("point", ["commit", "sample", "detokenize"])
def test_a_failing_request_aborts_alone(tiny_chat_model, monkeypatch, reference, point):
    engine = faulty_engine(tiny_chat_model, monkeypatch, point)
    try:
        outputs = run_batch(engine, ["ok-0", "fault-1", "ok-2"])
        reason = outputs[1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and point in reason["message"], reason
        assert [outputs[i]["output_ids"] for i in (0, 2)] == [reference[0], reference[2]]
        assert all(outputs[i]["meta_info"]["finish_reason"]["type"] == "length" for i in (0, 2))
        assert_healthy(engine, reference)
    finally:
        engine.shutdown()


def test_a_failing_forward_aborts_its_step_and_the_engine_goes_on(
    tiny_chat_model, monkeypatch, reference
):
    engine = faulty_engine(tiny_chat_model, monkeypatch, "forward")
    try:
        outputs = run_batch(engine, ["fault-0", "b", "c"])
        for output in outputs:  # admitted together: the one failing step held all three
            reason = output["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "forward" in reason["message"]
            assert reason["status_code"] == 500
        assert_healthy(engine, reference)
    finally:
        engine.shutdown()


def test_an_unexpected_step_error_aborts_everything_and_the_engine_goes_on(
    tiny_chat_model, monkeypatch, reference
):
    engine = make_engine(tiny_chat_model)
    schedule = engine.scheduler._schedule
    calls = []

    def broken_once():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("scheduler bug")
        return schedule()

    monkeypatch.setattr(engine.scheduler, "_schedule", broken_once)
    try:
        outputs = run_batch(engine, ["a", "b", "c"])
        assert {o["meta_info"]["finish_reason"]["type"] for o in outputs} == {"abort"}
        assert "scheduler bug" in outputs[0]["meta_info"]["finish_reason"]["message"]
        assert_healthy(engine, reference)
    finally:
        engine.shutdown()


@pytest.fixture
def stuck_grammar_engine(tiny_chat_model, monkeypatch):
    """An engine whose grammars never finish compiling."""
    stuck: Future = Future()
    monkeypatch.setattr(GrammarBackend, "compile_async", lambda self, kind, spec: stuck)
    engine = make_engine(tiny_chat_model)
    yield engine
    engine.shutdown()


def test_the_core_waits_instead_of_spinning_while_no_step_can_progress(stuck_grammar_engine):
    """A grammar that never finishes compiling: the core thread must sleep, not spin."""
    engine = stuck_grammar_engine
    outputs: list[dict] = []

    def consume() -> None:
        params = greedy(4, regex="[a-z]+")
        outputs.extend(engine.generate(input_ids=prompt_ids(0), sampling_params=params,
                                       rid="stuck", stream=True))  # fmt: skip

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_for(lambda: engine.get_stats()["num_compiling_reqs"] == 1)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(1.0)
    busy = (time.process_time() - cpu) / (time.perf_counter() - wall)
    assert busy < 0.25, f"the process used {busy:.0%} of a core while nothing could run"
    engine.abort_request("another")  # (neither is SGLang's no-op, an empty rid)
    engine.abort_request()
    assert engine.get_stats()["num_compiling_reqs"] == 1
    engine.abort_request(abort_all=True)
    thread.join(10)
    assert outputs[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.get_stats()["num_compiling_reqs"] == 0


def test_shutdown_ends_a_stream_still_waiting_on_the_core(stuck_grammar_engine):
    """A consumer blocked on a stream never got an answer once the engine shut down: the
    loop stopped before the core's last word (EngineDeadError) reached its task."""
    engine = stuck_grammar_engine
    errors: list[Exception] = []

    def consume() -> None:
        params = greedy(4, regex="[a-z]+")
        try:
            list(engine.generate(input_ids=prompt_ids(0), sampling_params=params, stream=True))
        except EngineDeadError as exc:
            errors.append(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_for(lambda: engine.get_stats()["num_compiling_reqs"] == 1)
    engine.shutdown()
    thread.join(10)
    assert not thread.is_alive() and "shut down" in str(errors[0])


def test_a_finished_grammar_compile_wakes_the_waiting_core_at_once(tiny_chat_model, monkeypatch):
    # The back-off would now sleep 600 s: only the compile's own wake-up can queue the request.
    monkeypatch.setattr(core_loop, "STALL_WAIT_MIN_S", 600.0)
    monkeypatch.setattr(core_loop, "STALL_WAIT_MAX_S", 600.0)
    compile_now = GrammarBackend.compile_async
    late: Future = Future()

    def compile_later(self, kind, spec):
        compiled = compile_now(self, kind, spec).result()
        threading.Timer(0.3, late.set_result, args=(compiled,)).start()
        return late

    monkeypatch.setattr(GrammarBackend, "compile_async", compile_later)
    engine = make_engine(tiny_chat_model)
    outputs: list[dict] = []
    params = greedy(4, regex="[a-z]+")
    thread = threading.Thread(
        target=lambda: outputs.append(
            engine.generate(input_ids=prompt_ids(0), sampling_params=params)
        )
    )
    try:
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the core slept through the compile finishing"
        assert outputs[0]["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        engine.shutdown()


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_rid_belongs_to_one_running_request(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    try:
        with pytest.raises(ValueError, match="rid 'same' is already in use"):
            engine.generate(input_ids=[prompt_ids(0), prompt_ids(1)], rid=["same", "same"])
        stream = engine.generate(input_ids=prompt_ids(0), rid="busy", stream=True,
                                 sampling_params=greedy(400))  # fmt: skip
        next(stream)
        with pytest.raises(ValueError, match="rid 'busy' is already in use"):
            engine.generate(input_ids=prompt_ids(1), rid="busy", sampling_params=greedy(2))
        stream.close()
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_reused_rid_never_sees_the_old_requests_tokens(tiny_chat_model):
    """A stream dropped mid-way aborts its request; a new request with the same rid, sent at
    once, gets exactly its own tokens and its own finish reason."""
    engine = make_engine(tiny_chat_model)
    expected = engine.generate(input_ids=prompt_ids(7), sampling_params=greedy(6))

    async def scenario():
        old = await engine.async_generate(input_ids=prompt_ids(3), rid="r", stream=True,
                                          sampling_params=greedy(300))  # fmt: skip
        await old.__anext__()
        await old.aclose()  # the client went away
        return await engine.async_generate(input_ids=prompt_ids(7), rid="r",
                                           sampling_params=greedy(6))  # fmt: skip

    try:
        reused = asyncio.run(scenario())
        assert reused["output_ids"] == expected["output_ids"]
        assert reused["meta_info"]["finish_reason"]["type"] == "length"
        assert reused["meta_info"]["id"] == "r"
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_streamed_logprobs_come_in_pieces_that_add_up(tiny_chat_model):
    """SGLang's streams: each chunk carries only its new output logprobs, and
    output_token_logprobs_length counts them all (== completion_tokens)."""
    engine = make_engine(tiny_chat_model)
    try:
        kwargs = dict(input_ids=prompt_ids(2), sampling_params=greedy(6), return_logprob=True,
                      top_logprobs_num=2, logprob_start_len=0)  # fmt: skip
        whole = engine.generate(**kwargs)["meta_info"]
        chunks = [c["meta_info"] for c in engine.generate(**kwargs, stream=True)]
    finally:
        engine.shutdown()
    assert len(chunks) > 1
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs"):
        assert [e for c in chunks for e in c[key]] == whole[key], key
    for chunk in chunks:
        assert chunk["output_token_logprobs_length"] == chunk["completion_tokens"]
    assert whole["output_token_logprobs_length"] == 6


class UnsendableClient(EngineClient):
    """A client whose messages cannot reach the core (e.g. they cannot be encoded)."""

    def _send(self, message) -> None:
        raise OverflowError("cannot encode")

    def close(self) -> None:
        pass


def test_requests_that_cannot_be_sent_are_not_left_registered():
    """Left registered, they would hold their rid and a queue slot forever, and the server's
    drain on SIGTERM would wait for them forever."""
    client = UnsendableClient()
    spec = RequestSpec(request_id="r1", rid="a", input_ids=[1], params=SamplingParams(), seed=0)

    async def submit():
        client.submit([spec], max_active=1)

    for _ in range(2):  # the second try finds the rid free and the queue empty again
        with pytest.raises(OverflowError):
            asyncio.run(submit())
    assert client.num_active == 0 and client.active_request_ids() == []
