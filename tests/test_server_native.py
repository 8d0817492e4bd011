"""`radixserve serve` in a subprocess: SGLang's native API, health, metrics, robustness."""

from __future__ import annotations

import asyncio
import hmac
import json
from types import SimpleNamespace

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ADMIN_API_KEY, ServerProcess, prompt_ids, stop_running
from radixserve.config import ServerConfig
from radixserve.server.app import build_app
from radixserve.server.auth import api_key_matches, needs_admin
from radixserve.server.errors import error_response

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
JSON_TYPE = {"Content-Type": "application/json"}


async def post(url: str, body, **kwargs):
    """POSTs `body` (raw if bytes or str, else as JSON) as Content-Type: application/json."""
    kwargs["headers"] = JSON_TYPE | kwargs.get("headers", {})
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with session.post(url, data=data, **kwargs) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text.startswith(("{", "[")) else text)


async def get(url: str, **kwargs):
    async with aiohttp.ClientSession() as session:
        async with session.get(url, **kwargs) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text.startswith(("{", "[")) else text)


async def stream_generate(url: str, body) -> list:
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=body | {"stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def run(coro):
    return asyncio.run(coro)


def test_generate_single_batch_and_null_fields(server):
    body = {"input_ids": prompt_ids(1), "sampling_params": GREEDY | {"regex": None, "stop": None}}
    status, single = run(post(server.url + "/generate", body))
    assert status == 200 and len(single["output_ids"]) == 8
    keys = {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}
    assert set(single["meta_info"]) >= keys | {"e2e_latency"}
    body = {"text": ["Hello there", "General"], "sampling_params": GREEDY}
    status, batch = run(post(server.url + "/generate", body))
    assert status == 200 and isinstance(batch, list) and len(batch) == 2
    assert all(isinstance(o["text"], str) for o in batch)


def test_stream_is_cumulative_and_ends_with_done(server):
    body = {"input_ids": prompt_ids(2), "sampling_params": GREEDY}
    events = run(stream_generate(server.url, body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    _, whole = run(post(server.url + "/generate", body))
    assert chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_logprob_layout_and_prefill_only(server):
    ids = prompt_ids(3, 20)
    body = {
        "input_ids": ids,
        "sampling_params": GREEDY | {"max_new_tokens": 3},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    _, out = run(post(server.url + "/generate", body))
    meta = out["meta_info"]
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == 20
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    prefix = prompt_ids(4, 48)
    body = {"input_ids": prefix, "sampling_params": {"max_new_tokens": 0}}
    _, cached = run(post(server.url + "/generate", body))
    assert cached["output_ids"] == []
    body = {"input_ids": prefix + [7, 8, 9], "sampling_params": GREEDY}
    _, hit = run(post(server.url + "/generate", body))
    assert hit["meta_info"]["cached_tokens"] == 48


def test_64_concurrent_streams_match_their_solo_outputs(server):
    bodies = [
        {"input_ids": prompt_ids(100 + i, 12 + i % 7), "sampling_params": GREEDY} for i in range(64)
    ]

    async def solo():
        return [(await post(server.url + "/generate", b))[1]["output_ids"] for b in bodies[:8]]

    async def together():
        return await asyncio.gather(*(stream_generate(server.url, b) for b in bodies))

    alone = run(solo())
    streams = run(together())
    assert all(s[-1] == "[DONE]" for s in streams)
    assert [s[-2]["output_ids"] for s in streams[:8]] == alone
    assert all(len(s[-2]["output_ids"]) == 8 for s in streams)


def test_disconnect_mid_stream_frees_pages(server):
    async def scenario():
        body = {"input_ids": prompt_ids(5, 40), "stream": True,
                "sampling_params": GREEDY | {"max_new_tokens": 2000}}  # fmt: skip
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/generate", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        break  # hang up after the first token
        for _ in range(100):
            _, info = await get(server.url + "/server_info")
            stats = info["stats"]
            if stats["num_running_reqs"] == 0 and info["num_active_requests"] == 0:
                return stats
            await asyncio.sleep(0.1)
        raise AssertionError(f"request still running after disconnect: {stats}")

    stats = run(scenario())
    held = stats["pool_capacity_pages"] - stats["pool_free_pages"] - stats["tree_pages"]
    assert held == 0
    assert run(post(server.url + "/flush_cache", {}))[0] == 200
    _, info = run(get(server.url + "/server_info"))
    assert info["stats"]["pool_free_pages"] == info["stats"]["pool_capacity_pages"]


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


def test_concate_and_append_request_is_accepted_and_validated(server):
    """SGLang's frontend posts this after joining the forks' texts itself, and hangs on any
    non-200; the joined text's next call is computed exactly from the cached prefix."""
    url = server.url + "/concate_and_append_request"
    ok = {"src_rids": ["a1", "b2"], "dst_rid": "p0"}
    assert run(post(url, ok)) == (200, {"success": True})
    bad = [
        ({"dst_rid": "p0"}, "src_rids"),
        ({"src_rids": [], "dst_rid": "p0"}, "src_rids"),
        ({"src_rids": "a1", "dst_rid": "p0"}, "src_rids"),
        ({"src_rids": ["a1", 2], "dst_rid": "p0"}, "src_rids"),
        ({"src_rids": ["a1"]}, "dst_rid"),
        ({"src_rids": ["a1"], "dst_rid": 7}, "dst_rid"),
        (["a1"], "body"),
    ]
    for body, field in bad:
        status, reply = run(post(url, body))
        assert status == 400 and reply["error"]["param"] == field, (body, reply)
        assert field in reply["error"]["message"] or field == "body"


def test_max_new_tokens_may_fill_the_context_exactly(server):
    body = {"input_ids": [1] * 2040, "sampling_params": GREEDY}  # 2040 + 8 = 2048
    status, out = run(post(server.url + "/generate", body))
    assert status == 200 and len(out["output_ids"]) == 8


def test_native_temperature_has_no_upper_bound(server):
    """SGLang's sampling_params.temperature is only >= 0; OpenAI's [0, 2] bound is not native."""
    body = {"input_ids": prompt_ids(1), "sampling_params": GREEDY | {"temperature": 5.0}}
    status, out = run(post(server.url + "/generate", body))
    assert status == 200 and len(out["output_ids"]) == 8


def test_top_logprobs_num_up_to_the_bound(server):
    body = {"input_ids": prompt_ids(2), "sampling_params": GREEDY | {"max_new_tokens": 2},
            "return_logprob": True, "top_logprobs_num": 20}  # fmt: skip
    status, out = run(post(server.url + "/generate", body))
    assert status == 200
    assert [len(top) for top in out["meta_info"]["output_top_logprobs"]] == [20, 20]


def test_seeds_beyond_64_bits_sample_like_their_low_64_bits(server):
    """A seed past 64 bits once failed to reach the core (a 500 and a request never freed)."""

    def output(seed: int) -> list[int]:
        params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
        body = {"input_ids": prompt_ids(3), "sampling_params": params | {"sampling_seed": seed}}
        status, out = run(post(server.url + "/generate", body))
        assert status == 200, out
        return out["output_ids"]

    assert output(2**64 + 5) == output(5)
    assert output(-1) == output(2**64 - 1)
    _, info = run(get(server.url + "/server_info"))
    assert info["num_active_requests"] == 0


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


def test_info_endpoints(server):
    status, info = run(get(server.url + "/get_model_info"))
    assert status == 200 and info["is_generation"] is True and info["model_path"]
    status, info = run(get(server.url + "/server_info"))
    assert status == 200 and info["page_size"] == 16 and "cache_hit_rate" in info["stats"]
    assert run(get(server.url + "/nope"))[0] == 404


def _metrics(server) -> dict[str, float]:
    _, text = run(get(server.url + "/metrics"))
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name + str(sorted(sample.labels.items()))] = sample.value
    return values


def test_metrics_parse_and_move(server):
    before = _metrics(server)
    run(post(server.url + "/generate", {"input_ids": prompt_ids(6), "sampling_params": GREEDY}))
    after = _metrics(server)
    for name in ("radixserve:prompt_tokens_total[]", "radixserve:generation_tokens_total[]",
                 "radixserve:e2e_request_latency_seconds_count[]",
                 "radixserve:time_to_first_token_seconds_count[]",
                 "radixserve:request_success_total[('finished_reason', 'length')]"):  # fmt: skip
        assert after[name] > before.get(name, 0), name
    assert "radixserve:kv_cache_usage_perc[]" in after
    assert "radixserve:num_requests_running[]" in after


@pytest.fixture(scope="module")
def own_servers(tiny_chat_model):
    """The servers of this module's tests that stop theirs, launched side by side on first
    use (each test waits for its own)."""
    servers = {
        "queue_limit": ServerProcess(
            tiny_chat_model, "--api-key", "sekret", "--max-running-requests", "1",
            "--max-queued-requests", "0", wait=False,
        ),
        "sigterm": ServerProcess(tiny_chat_model, wait=False),
    }  # fmt: skip
    yield servers
    stop_running(servers.values())


def test_api_key_and_queue_limit(own_servers):
    proc = own_servers["queue_limit"].wait_ready()
    try:
        body = {"input_ids": prompt_ids(7), "sampling_params": GREEDY}
        assert run(post(proc.url + "/generate", body))[0] == 401
        assert run(get(proc.url + "/health"))[0] == 200
        auth = {"Authorization": "Bearer sekret"}
        assert run(post(proc.url + "/generate", body, headers=auth))[0] == 200

        async def flood():
            long = {"input_ids": prompt_ids(8), "stream": True,
                    "sampling_params": GREEDY | {"max_new_tokens": 2000}}  # fmt: skip
            async with aiohttp.ClientSession() as session:
                async with session.post(proc.url + "/generate", json=long, headers=auth) as first:
                    await first.content.readline()  # the first request is running now
                    async with session.post(proc.url + "/generate", json=body, headers=auth) as r:
                        return first.status, r.status, r.headers.get("Retry-After")

        first_status, status, retry_after = run(flood())
        assert first_status == 200 and status == 503 and retry_after
    finally:
        assert proc.stop() == 0


KNOWN_ROUTES = {
    "/generate", "/abort_request", "/flush_cache", "/concate_and_append_request",
    "/get_model_info", "/model_info", "/server_info", "/get_server_info", "/health_generate",
    "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
    "/check_integrity", "/dashboard", "/dashboard/stats", "/dashboard/login", "/dashboard/{name}",
    "/cache/pin", "/cache/unpin", "/cache/sessions", "/cache/tree",
    "/v1/messages", "/v1/messages/count_tokens", "/load_lora_adapter", "/unload_lora_adapter",
    "/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items",
}  # fmt: skip
OPEN_ROUTES = {"/health", "/metrics"}  # probes and scrapers carry no key


def app_routes() -> list[tuple[str, str]]:
    """Every (method, path) the server answers, read from build_app's router, so a route
    added later is walked too."""
    app = build_app(SimpleNamespace(config=ServerConfig()))
    return sorted({(route.method, route.resource.canonical) for route in app.router.routes()})


def test_keys_guard_every_route_but_health_and_metrics(keyed_server):
    """No key or a wrong one: 401; the user key: 403 on admin routes only; the admin key:
    every route."""
    routes = app_routes()
    assert {path for _, path in routes} == KNOWN_ROUTES | OPEN_ROUTES
    assert {method for method, _ in routes} == {"GET", "HEAD", "POST", "DELETE"}
    proc = keyed_server

    async def status(session, method: str, path: str, authorization: str | None) -> int:
        headers = {} if authorization is None else {"Authorization": authorization}
        body = {} if method == "POST" else None
        request = session.request(
            method, proc.url + path, headers=headers, json=body, allow_redirects=False
        )
        async with request as r:
            return r.status

    async def walk() -> list:
        wrong = (None, "Bearer wrong", "Bearer sekre", "sekret", "bearer sekret")
        failures = []
        async with aiohttp.ClientSession() as session:
            for method, path in routes:
                without = [await status(session, method, path, auth) for auth in wrong]
                with_key = await status(session, method, path, "Bearer sekret")
                admin = await status(session, method, path, f"Bearer {ADMIN_API_KEY}")
                guarded = path not in OPEN_ROUTES
                ok = with_key != 401 and without == [401] * len(wrong) if guarded else (
                    with_key == 200 and without == [200] * len(wrong))  # fmt: skip
                ok = ok and admin not in (401, 403) and (with_key == 403) == needs_admin(path)
                if not ok:
                    failures.append((method, path, without, with_key, admin))
        return failures

    assert run(walk()) == []


def test_api_key_is_compared_in_constant_time(monkeypatch):
    compared, real = [], hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr("radixserve.server.auth.hmac.compare_digest", compare_digest)
    assert api_key_matches("Bearer k3y", "k3y") and compared
    assert not api_key_matches("Bearer k3", "k3y")
    assert not api_key_matches("Bearer k3y\u00e9", "k3y")  # not ASCII: False, not a TypeError
    assert len(compared) == 3


def test_sigterm_during_a_request_exits_cleanly(own_servers):
    proc = own_servers["sigterm"].wait_ready()

    async def scenario():
        body = {"input_ids": prompt_ids(9), "sampling_params": GREEDY | {"max_new_tokens": 200}}
        task = asyncio.create_task(post(proc.url + "/generate", body))
        await asyncio.sleep(0.5)
        proc.proc.send_signal(15)
        return await task

    status, reply = run(scenario())
    assert status == 200
    reason = reply["meta_info"]["finish_reason"]["type"]
    assert reason in ("length", "abort")
    assert proc.proc.wait(60) == 0


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
