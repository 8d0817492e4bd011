"""Prefill/decode disaggregation over HTTP: a prefill and a decode `radixserve serve` on
loopback, paired by the bootstrap fields (sent by the test, then by the real sglang-router in
PD mode), against the session's single worker (`server`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from native_http import get, post, run
from test_fleet import JSON, needs_router

from conftest import ServerProcess, prompt_ids
from radixserve_bench.systems import free_port

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
TIMEOUT = ("--disaggregation-transfer-timeout", "5", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def pd_servers(tiny_chat_model):
    bootstrap_port = free_port()
    prefill = ServerProcess(
        tiny_chat_model,
        *("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port"),
        *(str(bootstrap_port), *TIMEOUT),
        wait=False,
    )
    started = [prefill]
    try:  # both start side by side: neither needs the other until a request comes
        started.append(
            ServerProcess(tiny_chat_model, "--disaggregation-mode", "decode", *TIMEOUT, wait=False)
        )
        for proc in started:
            proc.wait_ready()
    except BaseException:
        for proc in started:
            proc.stop()
        raise
    decode = started[1]
    yield prefill, decode, bootstrap_port
    for proc in (prefill, decode):
        assert proc.stop() == 0, "".join(proc.log[-30:])


def boot(port: int, room) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}


async def both(prefill_url: str, decode_url: str, body: dict):
    """What sglang-router's PD mode does: the same body to both workers at once."""
    return await asyncio.gather(
        post(prefill_url + "/generate", body), post(decode_url + "/generate", body)
    )


async def assert_balanced(*urls: str) -> None:
    """Every page free, in the tree or held; nothing left running; a flush frees them all."""
    for url in urls:
        status, report = await get(url + "/check_integrity")
        assert status == 200 and report["num_running_reqs"] == 0, report
        assert (await post(url + "/flush_cache", {}))[0] == 200
        _, report = await get(url + "/check_integrity")
        assert report["pool_free_pages"] == report["pool_capacity_pages"]


def test_pd_pair_returns_a_single_workers_tokens(server, pd_servers):
    prefill, decode, port = pd_servers
    ids = [prompt_ids(1, 40), prompt_ids(2, 20)]
    body = {"input_ids": ids, "sampling_params": GREEDY} | boot(port, [101, 102])

    async def scenario():
        (p_status, p_out), (d_status, d_out) = await both(prefill.url, decode.url, body)
        _, single = await post(
            server.url + "/generate", {"input_ids": ids, "sampling_params": GREEDY}
        )
        assert p_status == d_status == 200
        assert [len(o["output_ids"]) for o in p_out] == [1, 1]  # prefill stops after the prompt
        assert [o["output_ids"] for o in d_out] == [o["output_ids"] for o in single]
        assert [o["meta_info"]["cached_tokens"] for o in d_out] == [32, 16]
        _, info = await get(decode.url + "/server_info")
        assert info["stats"]["kv_pages_received"] >= 3
        await assert_balanced(prefill.url, decode.url)

    run(scenario())


def test_a_failed_transfer_is_a_clear_error_and_frees_every_page(pd_servers):
    prefill, decode, port = pd_servers
    body = {"input_ids": prompt_ids(3, 40), "sampling_params": GREEDY}

    async def scenario():
        # nobody serves KV there
        status, out = await post(decode.url + "/generate", body | boot(free_port(), 7))
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "bootstrap_room 7" in reason["message"], out
        # the prefill side never gets the request: its room times out
        start = time.monotonic()
        _, out = await post(decode.url + "/generate", body | boot(port, 8))
        assert "bootstrap_room 8" in out["meta_info"]["finish_reason"]["message"]
        assert time.monotonic() - start < 15
        await assert_balanced(prefill.url, decode.url)

    run(scenario())


def test_bootstrap_fields_are_validated_naming_the_field(server, pd_servers):
    _, decode, port = pd_servers
    body = {"text": "hi", "sampling_params": GREEDY}

    async def scenario():
        status, out = await post(server.url + "/generate", body | boot(port, 1))
        assert status == 400 and out["error"]["param"] == "bootstrap_host"
        assert "--disaggregation-mode" in out["error"]["message"]
        for field, value in (("bootstrap_room", "x"), ("bootstrap_port", -1)):
            status, out = await post(
                decode.url + "/generate", body | boot(port, 1) | {field: value}
            )
            assert status == 400 and out["error"]["param"] == field, out
        status, out = await post(decode.url + "/generate", body | {"bootstrap_room": 3})
        assert status == 400 and out["error"]["param"] == "bootstrap_host"

    run(scenario())


@needs_router
def test_pd_through_the_real_router(server, pd_servers):
    prefill, decode, bootstrap_port = pd_servers
    router_port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        + ["--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url]
        + ["--host", "127.0.0.1", "--port", str(router_port), "--policy", "round_robin"]
        + ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{router_port}"
    try:
        _wait_healthy(url, router)
        body = {"input_ids": prompt_ids(9, 40), "sampling_params": GREEDY}
        status, routed = run(post(url + "/generate", body, headers=JSON))
        assert status == 200, routed
        _, single = run(post(server.url + "/generate", body))
        assert routed["output_ids"] == single["output_ids"]
        assert routed["meta_info"]["cached_tokens"] == 32  # the prompt's KV came from prefill
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi " * 30}],
            "max_tokens": 4,
        }
        status, out = run(post(url + "/v1/chat/completions", chat, headers=JSON))
        assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        run(assert_balanced(prefill.url, decode.url))
    finally:
        router.terminate()
        router.wait(30)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the router exited"
        try:
            if run(get(url + "/health"))[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"router at {url} not healthy in {timeout_s} s")
