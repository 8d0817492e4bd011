"""The HTTP fuzz's cases beyond request bodies, collected by tests/test_http_fuzz.py (which
imports them) against its one server:

- stored responses' routes, GET / DELETE /v1/responses/{id} and GET .../input_items, with odd
  ids (random text, very long, unicode, path traversal sent raw and escaped, ids of deleted
  responses and of another namespace's), odd queries and namespaces (X-Cache-Salt). Never a
  5xx; a 2xx only for a live response of the caller's namespace; a 4xx in OpenAI's shape
  naming response_id or the query parameter (a path that matches no route: none).
- clients that disconnect from a stream of /v1/chat/completions, /v1/responses or
  /v1/messages: before the answer, in its headers or mid-stream, closing (FIN) or resetting
  (RST), alone or several at once. Afterwards no request is left registered, no KV page is
  lost (/check_integrity) and the server still answers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import urllib.parse
from dataclasses import dataclass, field

import aiohttp
import pytest
import yarl
from fuzz_common import (
    FUZZ_SETTINGS,
    JSON_TYPE,
    MAX_EXAMPLES,
    REQUEST_TIMEOUT_S,
    assert_settled,
    encode,
    send,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

from radixserve.server.errors import error_type
from radixserve.server.limits import MAX_LINE_BYTES
from radixserve.server.tenants import SALT_HEADER

# ---- stored responses' ids ---------------------------------------------------------------

OWNER = "<owner>"
SALTS = [None, "fuzz-a", "fuzz-b", OWNER, OWNER]
"""The namespaces a request may name (None: none; OWNER: the stored response's own, half of
the time, so that the fuzz finds what it stored as often as it misses)."""
STORED, UNSALTED, DELETED = "<stored>", "<unsalted>", "<deleted>"
"""Placeholders for ids of responses the fixture stores: in fuzz-a, in no namespace, and one
deleted at once."""
ODD_IDS = [
    "", ".", "..", "../..", "../../flush_cache", "..%2F..%2Fflush_cache", "%2e%2e%2f%2e%2e",
    "resp_", "resp_0", "a/b", "a?b=1", "a#b", "%", "%zz", "%00", " ", "\u202e\u0000", "Ã¼",
    "\U0001f600" * 3, "resp_" + "f" * 48, "'; DROP TABLE responses; --",
]  # fmt: skip
LONG_IDS = st.sampled_from([300, 4000, 8100, 9000, 70000]).map(lambda n: "r" * n)
"""Long ids; a path past limits.MAX_LINE_BYTES is over the server's request-line limit,
which aiohttp answers (a plain-text 400, before any route or middleware runs: aiohttp has
no hook for it, aio-libs/aiohttp#3287) and then closes the connection."""
RESPONSE_ID = st.one_of(
    st.sampled_from([STORED, UNSALTED, DELETED]),
    st.sampled_from([STORED, UNSALTED, DELETED]),
    st.sampled_from(ODD_IDS),
    st.text(max_size=30),
    LONG_IDS,
)
ROUTES = {
    "retrieve": ("GET", ""),
    "input_items": ("GET", "/input_items"),
    "delete": ("DELETE", ""),
}
QUERIES = ["", "", "", "?include=", "?limit=2", "?limit=0", "?order=up", "?after=x", "?bogus=1"]
ITEMS_QUERY_KEYS = {"include", "limit", "order", "after"}
"""input_items' query parameters; the other routes take none (`include` empty aside)."""
ENCODINGS = ["escaped", "slashes kept", "raw"]


@dataclass
class StoredIds:
    """The responses the fixture stored: placeholder -> (id, namespace), and which live."""

    ids: dict[str, tuple[str, str | None]]
    live: set[str] = field(default_factory=set)


def create_stored(url: str, salt: str | None) -> str:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 1}
    headers = {SALT_HEADER: salt} if salt else None
    status, text = asyncio.run(send(url + "/v1/responses", body, headers))
    assert status == 200, text
    return json.loads(text)["id"]


@pytest.fixture(scope="module")
def stored_ids(fuzz_server) -> StoredIds:
    url = fuzz_server.url
    stored, unsalted, deleted = (create_stored(url, s) for s in ("fuzz-a", None, "fuzz-b"))
    status, _ = asyncio.run(
        request(url, "DELETE", f"/v1/responses/{deleted}", {SALT_HEADER: "fuzz-b"})
    )
    assert status == 200
    ids = {STORED: (stored, "fuzz-a"), UNSALTED: (unsalted, None), DELETED: (deleted, "fuzz-b")}
    return StoredIds(ids, live={STORED, UNSALTED})


def id_path(response_id: str, encoding: str) -> str:
    """The id as it goes into the path: escaped whole, escaped but for slashes, or as it is
    (where it is printable ASCII without a space, '?' or '#'; else escaped)."""
    printable = response_id.isascii() and response_id.isprintable()
    if encoding == "raw" and printable and not set(response_id) & set(" ?#"):
        return response_id
    return urllib.parse.quote(response_id, safe="/" if encoding == "slashes kept" else "")


async def request(url: str, method: str, path: str, headers: dict | None = None) -> tuple[int, str]:
    """`method` on `path`, sent as it is written (no normalizing of dot segments)."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        target = yarl.URL(url + path, encoded=True)
        async with session.request(method, target, headers=headers) as response:
            return response.status, await response.text()


def expected_status(route: str, query: str, found: bool) -> int:
    """The status of a request for a response the fixture stored: an unknown query parameter
    is a 400 first, then a response not found (deleted, another namespace's) a 404, then
    input_items' parameters are checked (a 400)."""
    keys = set(urllib.parse.parse_qs(query[1:], keep_blank_values=True))
    known_keys = ITEMS_QUERY_KEYS if route == "input_items" else {"include"}
    if keys - known_keys or (route != "input_items" and query not in ("", "?include=")):
        return 400
    if not found:
        return 404
    return 200 if query in ("", "?include=", "?limit=2") else 400


def id_problems(status: int, text: str, params: set[str], expected: int | None) -> list[str]:
    """What is wrong with an answer on a stored response's route. `params`: the names its
    error may give; `expected`: the status it must have, where the fuzz knows it."""
    if status >= 500 or (expected is not None and status != expected):
        return [f"{status} (expected {expected}): {text[:300]}"]
    if status < 400:
        return []
    try:
        error = json.loads(text)["error"]
        message, kind, param, code = (error[k] for k in ("message", "type", "param", "code"))
    except (ValueError, KeyError, TypeError):
        return [f"{status} without an OpenAI error body: {text[:300]}"]
    if code != status or kind != error_type(status) or not isinstance(message, str):
        return [f"{status} with a malformed error: {error}"]
    route_miss = status in (404, 405) and param is None  # no route: nothing to name
    if not route_miss and param not in params:
        return [f"{status} names {param!r}, not one of {sorted(params)}: {error}"]
    return []


@FUZZ_SETTINGS
@example(route="retrieve", response_id=STORED, encoding="raw", salt=OWNER, query="")
@example(route="input_items", response_id=UNSALTED, encoding="raw", salt=OWNER, query="")
@example(route="delete", response_id=UNSALTED, encoding="raw", salt=OWNER, query="")
@example(route="retrieve", response_id=UNSALTED, encoding="raw", salt=OWNER, query="")  # gone
# A DELETE with a query parameter (an unknown one) deleted the response: it is a 400 now, as
# on GET, and the response stays.
@example(route="delete", response_id=STORED, encoding="raw", salt=OWNER, query="?bogus=1")
@given(
    route=st.sampled_from(sorted(ROUTES)),
    response_id=RESPONSE_ID,
    encoding=st.sampled_from(ENCODINGS),
    salt=st.sampled_from(SALTS),
    query=st.sampled_from(QUERIES),
)
def test_fuzz_stored_response_ids(
    fuzz_server, stored_ids, route, response_id, encoding, salt, query
):
    method, suffix = ROUTES[route]
    known = response_id in stored_ids.ids
    real_id, owner = stored_ids.ids.get(response_id, (response_id, None))
    salt = owner if salt == OWNER else salt
    path = f"/v1/responses/{id_path(real_id, encoding)}{suffix}{query}"
    headers = {SALT_HEADER: salt} if salt else None
    status, text = asyncio.run(request(fuzz_server.url, method, path, headers))
    found = response_id in stored_ids.live and salt == owner
    expected = expected_status(route, query, found) if known else None
    params = {"response_id", *urllib.parse.parse_qs(query[1:], keep_blank_values=True)}
    if len(path.encode()) > MAX_LINE_BYTES:  # aiohttp's answer (see LONG_IDS)
        assert status == 400 and "Got more than" in text, (status, text[:300])
        return
    problems = id_problems(status, text, params, expected)
    assert not problems, (method, path[:200], salt, problems)
    if known and status == 200 and method == "GET" and route == "retrieve":
        assert json.loads(text)["id"] == real_id
    if known and status == 200 and method == "DELETE":
        stored_ids.live.discard(response_id)
    assert status != 200 or known, (method, path[:200], text[:300])  # nothing else is stored


# ---- clients that disconnect mid-stream --------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
STREAMS = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 160, "n": 2},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 160},
    "/v1/messages": {"model": "tiny", "max_tokens": 160, "messages": HI},
}
"""Streams long enough to be cut (the output is not stopped at EOS)."""
ANSWER_ONE = {
    "/v1/chat/completions": {"messages": HI, "max_tokens": 1},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 1, "store": False},
    "/v1/messages": {"model": "tiny", "max_tokens": 1, "messages": HI},
}
ANSWERED = {
    "/v1/chat/completions": lambda reply: reply["object"] == "chat.completion",
    "/v1/responses": lambda reply: reply["status"] in ("completed", "incomplete"),
    "/v1/messages": lambda reply: reply["type"] == "message",
}
READ_BYTES = [0, 1, 40, 400, 1500, 3000]
"""How much of the answer a client reads before it goes: nothing, part of the status line or
headers, the first events, more."""
CUT_RUNNING = 1500
"""Past this many bytes a stream's output events have come: its requests were running."""


async def disconnect(url: str, path: str, body: dict, read_bytes: int, reset: bool) -> bytes:
    """Sends `body` to `path` on a raw connection, reads `read_bytes` of the answer, then
    closes the connection (FIN) or, with `reset`, resets it (RST)."""
    host, port = yarl.URL(url).host, yarl.URL(url).port
    reader, writer = await asyncio.open_connection(host, port)
    data = encode(body)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {JSON_TYPE['Content-Type']}"
        f"\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    got = b""
    while len(got) < read_bytes:
        chunk = await asyncio.wait_for(reader.read(read_bytes - len(got)), REQUEST_TIMEOUT_S)
        if not chunk:
            break
        got += chunk
    if reset:
        linger = struct.pack("ii", 1, 0)  # on, 0 s: close() sends RST
        writer.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, linger
        )
    writer.close()
    return got


def aborted_count(url: str) -> float:
    """Requests the server ended as aborted (its finish-reason counter in /metrics)."""

    async def metrics() -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as response:
                return await response.text()

    line = 'radixserve:request_success_total{finished_reason="abort"} '
    counts = [
        float(x[len(line) :]) for x in asyncio.run(metrics()).split("\n") if x.startswith(line)
    ]
    return sum(counts)


@settings(FUZZ_SETTINGS, max_examples=max(MAX_EXAMPLES // 12, 1))  # each runs generations
@example(paths=sorted(STREAMS), read_bytes=1500, reset=True)
@given(
    paths=st.lists(st.sampled_from(sorted(STREAMS)), min_size=1, max_size=3),
    read_bytes=st.sampled_from(READ_BYTES),
    reset=st.booleans(),
)
def test_fuzz_disconnect_mid_stream(fuzz_server, paths, read_bytes, reset):
    url = fuzz_server.url
    bodies = [STREAMS[p] | {"stream": True, "ignore_eos": True} for p in paths]

    async def all_at_once():
        return await asyncio.gather(
            *(disconnect(url, p, b, read_bytes, reset) for p, b in zip(paths, bodies))
        )

    aborted_before = aborted_count(url)
    for got in asyncio.run(all_at_once()):
        assert b"HTTP/1.1 200".startswith(got[:12]), got[:300]  # what came was a 200
    assert_settled(url)  # every request ended, no page lost
    if read_bytes >= CUT_RUNNING:  # the streams ran, and were cut rather than run to the end
        assert aborted_count(url) >= aborted_before + len(paths)
    for path in set(paths):  # and the server still answers
        status, text = asyncio.run(send(url + path, ANSWER_ONE[path]))
        assert status == 200 and ANSWERED[path](json.loads(text)), text[:300]
