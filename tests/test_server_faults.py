"""`radixserve serve` under faults, for real: the engine core process killed under load,
faults injected into the core and the detokenizer, rids reused and colliding, bursts past the
queue limit, and a huge prompt that must not stall the event loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from conftest import ServerProcess, prompt_ids, stop_running
from radixserve.engine.faults import ENV_VAR

GREEDY = {"temperature": 0, "ignore_eos": True}


async def post(session: aiohttp.ClientSession, url: str, body: dict, **kwargs):
    async with session.post(url, json=body, **kwargs) as resp:
        text = await resp.text()
        return resp.status, (json.loads(text) if text.startswith(("{", "[")) else text)


async def stream_events(session: aiohttp.ClientSession, url: str, body: dict) -> list:
    events = []
    async with session.post(url, json=body | {"stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                payload = line[len(b"data: ") :].strip().decode()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


POINTS = ["commit", "forward", "detokenize"]


@pytest.fixture(scope="module")
def own_servers(tiny_chat_model):
    """This module's own servers, launched side by side on first use (each test waits for
    its own): one to kill, one with a tiny queue, and the faulty one."""
    servers = {
        "kill": ServerProcess(tiny_chat_model, wait=False),
        "burst": ServerProcess(tiny_chat_model, "--max-running-requests", "2",
                               "--max-queued-requests", "1", wait=False),
    }  # fmt: skip
    rules = [{"rid_prefix": f"{point}-", "points": [point]} for point in POINTS]
    os.environ[ENV_VAR] = json.dumps(rules)
    try:
        servers["faulty"] = ServerProcess(tiny_chat_model, wait=False)
    finally:
        del os.environ[ENV_VAR]
    yield servers
    stop_running(servers.values())


@pytest.fixture(scope="module")
def faulty_server(own_servers):
    """A server that fails a request whose rid starts with "<point>-" at that point."""
    proc = own_servers["faulty"].wait_ready()
    yield proc
    assert proc.stop() == 0


async def integrity(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/check_integrity") as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


# ---- the core process dies ------------------------------------------------------------------


def test_killing_the_core_fails_requests_at_once_and_the_server_exits(own_servers):
    proc = own_servers["kill"].wait_ready()

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.get(proc.url + "/server_info") as resp:
                core_pid = (await resp.json())["engine"]["pid"]
            url = proc.url + "/generate"
            long = {"sampling_params": GREEDY | {"max_new_tokens": 2000}}
            plain = asyncio.create_task(post(session, url, long | {"input_ids": prompt_ids(1)}))
            streamed = asyncio.create_task(
                stream_events(session, url, long | {"input_ids": prompt_ids(2)})
            )
            await asyncio.sleep(1.0)  # both are decoding now
            killed_at = time.monotonic()
            os.kill(core_pid, signal.SIGKILL)
            plain_status, plain_body = await asyncio.wait_for(plain, 10)
            events = await asyncio.wait_for(streamed, 10)
            failed_in = time.monotonic() - killed_at
            status, body = await post(session, url, {"input_ids": prompt_ids(3)})
            async with session.get(proc.url + "/health") as resp:
                health = resp.status
            return plain_status, plain_body, events, failed_in, status, body, health

    plain_status, plain_body, events, failed_in, status, body, health = asyncio.run(scenario())
    assert plain_status == 503 and "engine core" in plain_body["error"]["message"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
    assert failed_in < 5
    assert status == 503 and body["error"]["code"] == 503
    assert health == 503
    assert proc.proc.wait(timeout=15) != 0  # exits by itself, non-zero, for a supervisor


# ---- injected faults ------------------------------------------------------------------------


@pytest.mark.parametrize("point", POINTS)
def test_injected_faults_abort_their_requests_and_the_server_goes_on(faulty_server, point):
    proc = faulty_server

    async def scenario():
        async with aiohttp.ClientSession() as session:
            url, params = proc.url + "/generate", GREEDY | {"max_new_tokens": 6}
            body = {"input_ids": [prompt_ids(i) for i in range(3)], "sampling_params": params}
            batch = await post(session, url, body | {"rid": ["ok-0", f"{point}-1", "ok-2"]})
            rids = ["a", f"{point}-b", "c"]
            stream = await stream_events(session, url, body | {"rid": rids})
            after = await post(
                session, url, {"input_ids": prompt_ids(0), "sampling_params": params}
            )
            await post(session, proc.url + "/flush_cache", {})
            return batch, stream, after, await integrity(session, proc.url)

    (status, outputs), events, (after_status, after), pages = asyncio.run(scenario())
    assert status == 200
    reasons = [o["meta_info"]["finish_reason"] for o in outputs]
    assert reasons[1]["type"] == "abort" and point in reasons[1]["message"]
    if point != "forward":  # a failing forward takes its whole step down; the others never
        assert reasons[0]["type"] == reasons[2]["type"] == "length"
        assert outputs[0]["output_ids"] == after["output_ids"]
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"]}
    assert finals[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert after_status == 200 and after["meta_info"]["finish_reason"]["type"] == "length"
    assert pages["pool_free_pages"] == pages["pool_capacity_pages"]


# ---- request identity -----------------------------------------------------------------------


def test_a_running_rid_is_refused_and_a_dropped_ones_rid_is_free_at_once(server):
    async def scenario():
        async with aiohttp.ClientSession() as session:
            long = {"input_ids": prompt_ids(4), "rid": "mine", "stream": True,
                    "sampling_params": GREEDY | {"max_new_tokens": 2000}}  # fmt: skip
            async with session.post(server.url + "/generate", json=long) as resp:
                await resp.content.readline()
                clash = await post(session, server.url + "/generate",
                                   {"input_ids": prompt_ids(5), "rid": "mine"})  # fmt: skip
            # hung up: the rid is free again, and the new request sees only its own tokens
            short = {"input_ids": prompt_ids(6), "rid": "mine",
                     "sampling_params": GREEDY | {"max_new_tokens": 5}}  # fmt: skip
            reused = await post(session, server.url + "/generate", short)
            alone = await post(session, server.url + "/generate", short | {"rid": "other"})
            return clash, reused, alone

    (clash_status, clash), (status, reused), (_, alone) = asyncio.run(scenario())
    assert clash_status == 400 and "rid" in clash["error"]["message"]
    assert status == 200 and reused["meta_info"]["id"] == "mine"
    assert reused["meta_info"]["finish_reason"]["type"] == "length"
    assert reused["output_ids"] == alone["output_ids"]


# ---- capacity -------------------------------------------------------------------------------


def test_a_burst_never_exceeds_the_queue_limit(own_servers):
    """The capacity check and the registration are one step: of 12 simultaneous requests
    against room for 3, exactly 3 run and 9 are told to retry."""
    proc = own_servers["burst"].wait_ready()

    async def scenario():
        body = {"input_ids": prompt_ids(1), "sampling_params": GREEDY | {"max_new_tokens": 300}}
        async with aiohttp.ClientSession() as session:
            replies = await asyncio.gather(
                *(post(session, proc.url + "/generate", body) for _ in range(12))
            )
            async with session.get(proc.url + "/health_generate") as resp:
                health = resp.status
            return [status for status, _ in replies], health

    try:
        statuses, health = asyncio.run(scenario())
    finally:
        proc.stop()
    assert sorted(statuses) == [200] * 3 + [503] * 9
    assert health == 200


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    """While a multi-megabyte prompt is tokenized, other requests are still answered."""

    async def scenario():
        async with aiohttp.ClientSession() as session:
            huge = {"text": "lorem ipsum dolor sit amet " * 150_000, "sampling_params": GREEDY}
            big = asyncio.create_task(post(session, server.url + "/generate", huge))
            await asyncio.sleep(0.3)  # the big body has arrived and is being tokenized
            async with session.get(server.url + "/health") as resp:
                health_status = resp.status
            health_done = big.done()
            return health_status, health_done, await big

    health_status, big_done_before_health, (big_status, big_body) = asyncio.run(scenario())
    assert health_status == 200
    assert not big_done_before_health, "health waited for the tokenizer"
    assert big_status == 400 and "context length" in big_body["error"]["message"]


def test_an_orphaned_core_stops_quietly_when_the_server_end_is_gone(caplog):
    import multiprocessing

    from radixserve.engine.core_process import PipeTransport
    from radixserve.engine.protocol import StepOutputs

    server_end, core_end = multiprocessing.Pipe()
    transport = PipeTransport(core_end)
    server_end.close()  # the HTTP process died
    with caplog.at_level("INFO", logger="radixserve.engine.core_process"):
        transport.send(StepOutputs([]))  # no BrokenPipeError traceback
        transport.send(StepOutputs([]))
    assert [r.message for r in caplog.records] == ["the server process is gone; the core stops"]
    assert transport.receive(None) is None  # the core loop ends
