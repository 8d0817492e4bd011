"""`radixserve serve`'s API keys and limits, and its shutdown: the keys guard every route
but /health and /metrics (conftest's `keyed_server`) and are compared in constant time; a
server of this module's own answers 401 without the key and 503 past its queue, and another
exits cleanly on SIGTERM during a request."""

from __future__ import annotations

import asyncio
import hmac
from types import SimpleNamespace

import aiohttp
import pytest
from native_http import GREEDY, get, post, run

from conftest import ADMIN_API_KEY, ServerProcess, prompt_ids, stop_running
from radixserve.config import ServerConfig
from radixserve.server.app import build_app
from radixserve.server.auth import api_key_matches, needs_admin


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
    "/v1/models", "/v1/models/{model}", "/v1/completions", "/v1/chat/completions",
    "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize",
    "/check_integrity", "/dashboard", "/dashboard/stats", "/dashboard/login", "/dashboard/{name}",
    "/cache/pin", "/cache/unpin", "/cache/sessions", "/cache/tree",
    "/v1/messages", "/v1/messages/count_tokens", "/load_lora_adapter", "/unload_lora_adapter",
    "/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items",
    "/open_session", "/close_session", "/version", "/reset_prefix_cache",
    "/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
    "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel",
    "/get_load", "/api/version", "/api/tags", "/api/ps", "/v1/conversations",
    "/v1/conversations/{conversation_id}", "/v1/conversations/{conversation_id}/items",
    "/v1/conversations/{conversation_id}/items/{item_id}", "/api/show", "/api/chat",
    "/api/generate", "/encode", "/v1/embeddings", "/api/embed", "/api/embeddings",
    "/classify", "/v1/classify", "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank", "/score",
}  # fmt: skip
OPEN_ROUTES = {"/health", "/ping", "/metrics", "/"}  # probes and scrapers carry no key


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
