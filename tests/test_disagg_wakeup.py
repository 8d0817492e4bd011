"""Arrival wakes an idle decode worker: the fetch of a request's KV wakes its core at once (no
step spent polling), and the pipe transport wakes from another thread."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading

from disagg_cores import HOST, PAGE, core, request, rooms, run

from conftest import greedy, prompt_ids
from radixserve.client.inproc_client import InProcessClient
from radixserve.engine import core_loop
from radixserve.engine.core_process import PipeTransport
from radixserve.engine.protocol import AbortRequests, Bootstrap, RequestSpec
from radixserve.engine.wire import encode
from radixserve.sampling.params import SamplingParams


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
    ids, room, port = prompt_ids(8, 40), next(rooms), prefill.scheduler.handoff.bootstrap_port

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
