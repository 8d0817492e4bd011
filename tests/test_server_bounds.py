"""A running server's bounds on what one client can make it hold: a stalled request, pins and
sessions past their cap, names past their length, a huge /tokenize, a polled /cache/tree."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from aiohttp.http_exceptions import BadHttpMessage
from native_http import get, post

from conftest import ServerProcess, prompt_ids
from radixserve.cache.retention import MAX_PIN_NAME_CHARS
from radixserve.server.cache_api import TREE_CACHE_S
from radixserve.server.limits import LINGERING_TIME_S

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
TIMEOUT_S = 1.0  # --timeout-keep-alive and --http-read-timeout of this module's server
MAX_PINS = 4


@pytest.fixture(scope="module")
def bounded(tiny_chat_model):
    proc = ServerProcess(
        tiny_chat_model,
        *("--max-pins", str(MAX_PINS)),
        *("--timeout-keep-alive", str(TIMEOUT_S), "--http-read-timeout", str(TIMEOUT_S)),
    )
    yield proc
    assert proc.stop() == 0


async def stall(port: int, sent: bytes) -> tuple[bytes, float]:
    """Sends `sent` and then nothing; what the server answers until it closes the connection,
    and after how long it closed it."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(sent)
    try:
        answer = await asyncio.wait_for(reader.read(), 10 * (TIMEOUT_S + LINGERING_TIME_S))
    finally:
        writer.close()
    return answer, time.monotonic() - start


def test_a_stalled_request_body_gets_408_and_is_dropped_while_others_are_served(bounded):
    head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"input_ids\": [1, ")  # fmt: skip

    async def go():
        stalled = asyncio.create_task(stall(bounded.port, head))
        await asyncio.sleep(0.2)
        body = {"input_ids": prompt_ids(1), "sampling_params": GREEDY}
        assert (await post(bounded.url + "/generate", body))[0] == 200
        return await stalled

    answer, closed_after = asyncio.run(go())
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", answer
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["param"] == "body" and "--http-read-timeout" in error["message"]
    assert TIMEOUT_S <= closed_after < TIMEOUT_S + LINGERING_TIME_S + 2.0


def test_stalled_headers_and_an_idle_connection_are_closed(bounded):
    async def go():
        return await asyncio.gather(
            stall(bounded.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "),
            stall(bounded.port, b""),
        )

    for answer, closed_after in asyncio.run(go()):
        assert answer == b"" and TIMEOUT_S <= closed_after < TIMEOUT_S + 2.0


def test_sessions_and_pins_stop_at_the_count_cap_and_names_at_their_length(bounded):
    url = bounded.url

    async def pin(name: str, seed: int):
        return await post(url + "/cache/pin", {"input_ids": prompt_ids(seed, 40), "name": name})

    async def session(session_id: str, seed: int):
        body = {"input_ids": prompt_ids(seed, 40), "sampling_params": GREEDY,
                "session_id": session_id, "retention": {"ttl_s": 600}}  # fmt: skip
        return await post(url + "/generate", body)

    async def listed() -> list[tuple[str, str]]:
        return [(p["kind"], p["name"]) for p in (await get(url + "/cache/sessions"))[1]["pins"]]

    async def go():
        for i in range(6):
            assert (await session(f"s{i}", 40 + i))[0] == 200
        assert await listed() == [("session", f"s{i}") for i in range(2, 6)]  # oldest ended
        for i in range(MAX_PINS):  # each takes the place of the oldest session
            status, body = await pin(f"p{i}", 60 + i)
            assert status == 200 and body["pinned"], body
        status, body = await pin("p-late", 70)
        assert status == 429 and body["error"]["param"] == "name", body
        assert "--max-pins" in body["error"]["message"]
        status, body = await pin("p0", 60)  # renewing a live pin is not a new one
        assert status == 200 and body["pinned"]
        assert (await session("s-late", 71))[0] == 200  # served, its pin refused
        assert await listed() == [("prefix", f"p{i}") for i in (1, 2, 3, 0)]
        stats = (await get(url + "/server_info"))[1]["stats"]
        assert stats["max_pins"] == MAX_PINS and stats["pins_refused"] >= 1
        long_name = "x" * (MAX_PIN_NAME_CHARS + 1)
        status, body = await pin(long_name, 72)
        assert status == 400 and body["error"]["param"] == "name"
        status, body = await session(long_name, 73)
        assert status == 400 and body["error"]["param"] == "session_id", body
        assert (await post(url + "/cache/unpin", {"name": "p1"}))[0] == 200
        assert (await pin("p-late", 70))[1]["pinned"]  # room again

    asyncio.run(go())


def test_tokenizing_a_huge_prompt_does_not_stall_the_event_loop(bounded):
    """/health keeps answering while a long prompt tokenizes: on the event loop, no probe could
    finish during it, and the one in flight would wait for all of it."""
    prompt = " ".join(f"w{i * 7919 % 100_003}x{i % 97}" for i in range(50_000))  # ~0.5 MB

    async def go():
        start = time.monotonic()
        tokenize = asyncio.create_task(post(bounded.url + "/tokenize", {"prompt": prompt}))
        latencies = []
        while not tokenize.done() and len(latencies) < 2000:
            sent = time.monotonic()
            assert (await get(bounded.url + "/health"))[0] == 200
            latencies.append(time.monotonic() - sent)
            await asyncio.sleep(0.01)
        status, body = await tokenize
        assert status == 200 and body["count"] > 50_000
        return latencies, time.monotonic() - start

    latencies, took = asyncio.run(go())
    assert len(latencies) >= 10 and max(latencies) < took / 2, (took, sorted(latencies)[-5:])


def test_cache_tree_is_walked_once_per_interval_however_often_it_is_asked(bounded):
    url = bounded.url

    async def tree(top_k: int = 1000) -> dict:
        status, body = await get(url + f"/cache/tree?top_k={top_k}")
        assert status == 200, body
        return body

    async def go():
        start = time.monotonic()
        first = await tree()
        body = {"input_ids": prompt_ids(90, 40), "sampling_params": GREEDY}
        assert (await post(url + "/generate", body))[0] == 200
        again = await asyncio.gather(*[tree() for _ in range(20)])
        assert time.monotonic() - start < TREE_CACHE_S  # else the test could not tell
        assert all(t == first for t in again)  # one summary answered them all
        assert len((await tree(top_k=1))["largest_subtrees"]) == 1
        await asyncio.sleep(TREE_CACHE_S)
        assert (await tree())["num_tokens"] > first["num_tokens"]  # the new prompt, now

    asyncio.run(go())


def test_malformed_requests_get_400_and_at_most_a_log_line_per_interval(bounded):
    """aiohttp logged each with an ERROR traceback: a client could fill the log at will."""
    malformed = [
        b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",  # URL past its limit
        b"NOT A REQUEST LINE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"b" * 10_000 + b"\r\n\r\n",
    ]
    before = len(bounded.log)

    async def go():
        answers = []
        for sent in malformed * 10:
            reader, writer = await asyncio.open_connection("127.0.0.1", bounded.port)
            writer.write(sent)
            answers.append(await asyncio.wait_for(reader.read(), 10))
            writer.close()
        return answers

    for answer in asyncio.run(go()):
        assert answer.split(b" ")[1] == b"400", answer[:80]  # (HTTP/1.0 for a bad line)
    assert asyncio.run(get(bounded.url + "/health"))[0] == 200
    time.sleep(0.5)  # the server's output reaches bounded.log from its reader thread
    added = bounded.log[before:]
    assert not any("Traceback" in line for line in added), "".join(added)
    assert len([line for line in added if "malformed HTTP request" in line]) <= 1


def test_the_malformed_request_filter_counts_what_it_held_back():
    from aiohttp.http_exceptions import LineTooLong

    from radixserve.server.http_runner import MalformedRequestFilter

    def record(exc: Exception | None) -> logging.LogRecord:
        info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("aiohttp.server", logging.ERROR, "", 0, "Error", (), info)

    held = MalformedRequestFilter(interval_s=3600)
    first = record(LineTooLong("url", 8190))
    assert held.filter(first) and first.levelno == logging.WARNING and first.exc_info is None
    assert "1 malformed HTTP request(s)" in first.getMessage()
    assert not held.filter(record(LineTooLong("url", 8190)))  # within the interval
    assert held.unreported == 1 and held.filter(record(None))  # other errors pass untouched
    every = MalformedRequestFilter(interval_s=0)
    for _ in range(2):
        assert every.filter(record(LineTooLong("header", 8190)))
    preface = BadHttpMessage("Invalid method encountered:\n\n  b'PRI/Upgrade'")
    assert not every.filter(record(preface))  # sglang-router's HTTP/2 probe: no line at all
