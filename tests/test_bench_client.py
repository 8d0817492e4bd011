"""The bench client's connection handling: a server that drops its idle keep-alive connections
(as llama-server does) costs no request, while a real server error still counts as a failure."""

from __future__ import annotations

import asyncio
import json

from radixserve_bench.backends import NativeBackend
from radixserve_bench.client import LoadShape, run_online
from radixserve_bench.workloads import BenchRequest, Workload

FAIL_FIRST_TOKEN = 7  # the fake server answers 500 to prompts that start with it


async def read_request(reader: asyncio.StreamReader) -> dict | None:
    """One HTTP request's JSON body, or None when the client closed the connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.decode().split("\r\n"):
        if line.lower().startswith("content-length:"):
            length = int(line.split(":")[1])
    body = await reader.readexactly(length)
    return json.loads(body) if body else {}


def sse_answer(prompt: list[int]) -> bytes:
    meta = {"prompt_tokens": len(prompt), "completion_tokens": 1, "cached_tokens": 0}
    body = f"data: {json.dumps({'output_ids': [5], 'meta_info': meta})}\n\ndata: [DONE]\n\n"
    head = ("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return (head + body).encode()


ERROR_500 = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nboom"


async def keep_alive_dropper(reader, writer) -> None:
    """Answers the first request of a connection and keeps it open (no `Connection: close`),
    then reads the next request on it and closes without answering: a server that dropped
    the idle connection just as the client reused it."""
    try:
        body = await read_request(reader)
        prompt = body.get("input_ids") or []
        writer.write(ERROR_500 if prompt[:1] == [FAIL_FIRST_TOKEN] else sse_answer(prompt))
        await writer.drain()
        await read_request(reader)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


def workload(first_tokens: list[int]) -> Workload:
    requests = [BenchRequest(None, [t, 100, 101], 1, conversation=i)
                for i, t in enumerate(first_tokens)]  # fmt: skip
    return Workload("client-test", requests, {})


async def run_against_dropper(first_tokens: list[int]):
    server = await asyncio.start_server(keep_alive_dropper, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = NativeBackend(f"http://127.0.0.1:{port}")
    load = LoadShape(max_concurrency=1, num_warmup=0)  # one at a time: a pool would reuse
    async with server:
        return await run_online(workload(first_tokens), backend, load, page_size=16,
                                progress=False)  # fmt: skip


def test_dropped_keep_alive_connections_cost_no_request():
    run = asyncio.run(run_against_dropper([11, 12, 13, 14, 15, 16]))
    assert [r.error for r in run.results] == [""] * 6
    assert run.metrics["completed"] == 6 and run.metrics["failed"] == 0


def test_a_real_server_error_still_counts():
    run = asyncio.run(run_against_dropper([11, FAIL_FIRST_TOKEN, 13]))
    assert run.metrics["completed"] == 2 and run.metrics["failed"] == 1
    assert run.results[1].error.startswith("HTTP 500")


async def never_answer_12(reader, writer) -> None:
    """Answers at once, except prompts that start with 12: those it never answers."""
    try:
        body = await read_request(reader)
        prompt = body.get("input_ids") or []
        if prompt[:1] != [12]:
            writer.write(sse_answer(prompt))
            await writer.drain()
        await reader.read()  # until the client gives up
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


def test_a_time_limit_fails_the_requests_still_out():
    async def run():
        server = await asyncio.start_server(never_answer_12, "127.0.0.1", 0)
        backend = NativeBackend(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        async with server:
            return await run_online(workload([11, 12, 11]), backend, LoadShape(num_warmup=0),
                                    page_size=16, progress=False, time_limit=1.0)  # fmt: skip

    run = asyncio.run(run())
    assert [r.success for r in run.results] == [True, False, True]
    assert run.results[1].error == "not finished within the 1 s cap"
    assert 1.0 <= run.metrics["duration"] < 10
