"""`radixserve serve` (conftest's shared `server`) refuses bad native requests with a 4xx
naming the field: bad /generate bodies, a body over the size limit (checked before it is
read), a wrong method; and the JSON type of an error status."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from native_http import GREEDY, JSON_TYPE, get, post, run

from conftest import prompt_ids
from radixserve.server.errors import error_response

BAD_GENERATE = [
    (b"{not json", "body"),
    (b"[1, 2]", "body"),
    ({}, "input_ids"),
    ({"text": "a", "input_ids": [1]}, "input_ids"),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": [1, "x"]}, "input_ids"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"input_ids": [10**9]}, "input_ids"),
    ({"input_ids": [1] * 5000}, "context length"),
    (
        {"input_ids": [1] * 30, "sampling_params": {"max_new_tokens": 5000}},
        "max_new_tokens is 5000 but the context length is 2048 and the prompt has 30 tokens: "
        "at most 2018 tokens can be generated",
    ),
    ({"input_ids": [1] * 2000}, "max_new_tokens is 128"),  # SGLang's default max_new_tokens
    ({"text": "a", "sampling_params": "hot"}, "sampling_params"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "a", "sampling_params": {"min_p": 2}}, "min_p"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"n": 0}}, "n"),
    ({"text": "a", "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
    ({"text": "a", "sampling_params": {"presence_penalty": -3}}, "presence_penalty"),
    ({"text": "a", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"text": "a", "sampling_params": {"stop": 5}}, "stop"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [-4]}}, "stop_token_ids"),
    (
        {"text": "a", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}},
        "min_new_tokens",
    ),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"text": "a", "sampling_params": {"regex": "[a-z"}}, "regex"),
    ({"text": "a", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ({"text": "a", "sampling_params": {"json_schema": {"type": "nonsense"}}}, "json_schema"),
    ({"text": "a", "sampling_params": {"ebnf": "root ::= undefined_rule"}}, "ebnf"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": -5}, "logprob_start_len"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 2.5}, "top_logprobs_num"),
    ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),  # checked without logprobs too
    ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "a", "sampling_params": {"n": -1}}, "n"),
    ({"text": "a", "sampling_params": {"n": 10**8}}, "n"),  # never built: over the limit
    ({"text": "a", "sampling_params": {"min_new_tokens": -1}}, "min_new_tokens"),
    ({"text": "a", "rid": 5}, "rid"),
    ({"text": ["a", "b"], "rid": "one"}, "rid"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "image_data": "abc"}, "image_data"),
    ({"text": "a", "cache_salt": 5}, "cache_salt"),
]


def test_bad_generate_requests_get_4xx_naming_the_field(server):
    async def check_all():
        failures = []
        for body, field in BAD_GENERATE:
            status, reply = await post(server.url + "/generate", body)
            message = reply["error"]["message"] if isinstance(reply, dict) else str(reply)
            if not (400 <= status < 500 and field in message):
                failures.append((body, status, reply))
        return failures

    assert run(check_all()) == []
    assert len(BAD_GENERATE) >= 30
    status, reply = run(post(server.url + "/abort_request", {"rid": 3}))
    assert status == 400 and "rid" in reply["error"]["message"]
    status, reply = run(post(server.url + "/generate", b"x" * (33 << 20)))
    assert status == 413
    assert run(get(server.url + "/health"))[0] == 200
    assert run(get(server.url + "/health_generate"))[0] == 200


MAX_BODY = 32 << 20  # the default --max-body-mb


async def send_head(port: int, content_length: int) -> tuple[int, dict]:
    """POSTs /generate announcing `content_length` bytes but sends one; returns the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n\r\n{{")  # fmt: skip
    writer.write(head.encode())
    try:
        response_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        status_line, *header_lines = response_head.decode().strip().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in header_lines)
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    finally:
        writer.close()
    assert headers.get("connection") == "close"  # the unread body is not kept for a next request
    return int(status_line.split()[1]), json.loads(body)


def test_body_size_is_checked_before_the_body_is_read(server):
    """A too-long Content-Length is answered at once: without the check, the server would
    wait (here forever) for the body it was promised."""
    status, reply = run(send_head(server.port, MAX_BODY + 1))
    assert status == 413 and reply["error"]["param"] == "body"
    assert f"{MAX_BODY + 1} bytes" in reply["error"]["message"]

    async def post_chunked() -> tuple[int, dict]:  # no Content-Length: client_max_size bounds it
        async def chunks():
            for _ in range(33):
                yield b" " * (1 << 20)

        async with aiohttp.ClientSession() as session:
            post = session.post(server.url + "/generate", data=chunks(), headers=JSON_TYPE)
            async with post as resp:
                assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
                return resp.status, await resp.json()

    status, reply = run(post_chunked())
    assert status == 413 and reply["error"]["param"] == "body"
    body = json.dumps({"input_ids": prompt_ids(1), "sampling_params": GREEDY})
    padded = body.encode().ljust(MAX_BODY, b" ")  # exactly at the limit: accepted
    status, reply = run(post(server.url + "/generate", padded))
    assert status == 200 and len(reply["output_ids"]) == 8


def test_wrong_method_is_a_json_405(server):
    for path in ("/generate", "/flush_cache", "/v1/chat/completions"):  # a GET changes nothing
        status, reply = run(get(server.url + path))
        assert status == 405 and reply["error"]["code"] == 405, (path, reply)
        assert reply["error"]["type"] == "MethodNotAllowedError", (path, reply)


@pytest.mark.parametrize("status", [408, 411, 413, 416, 500, 502])
def test_a_status_without_a_type_of_its_own_is_a_bad_request_or_an_internal_error(status):
    body = json.loads(error_response(status, "Refused.").body)
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    assert body["error"] == {"message": "Refused.", "type": kind, "param": None, "code": status}
