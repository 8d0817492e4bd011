"""`radixserve serve` with retention: /cache/pin, /cache/unpin, /cache/sessions, /cache/tree,
and the retention fields of /generate and the OpenAI extra body."""

from __future__ import annotations

import asyncio

import pytest
from native_http import get, post

from conftest import ServerProcess, prompt_ids

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def retention_server(tiny_chat_model):
    proc = ServerProcess(
        tiny_chat_model, "--served-model-name", "tiny", "--enable-priority-scheduling"
    )
    yield proc
    proc.stop()


def test_pin_list_tree_and_unpin_a_prefix(retention_server):
    url = retention_server.url
    tools = prompt_ids(3, 70)

    async def go():
        status, body = await post(url + "/cache/pin", {"input_ids": tools, "name": "tools"})
        assert status == 200 and body["pinned"], body
        assert body["pin"]["num_tokens"] == 64  # whole pages of 16
        status, listed = await get(url + "/cache/sessions")
        assert status == 200
        assert [(p["kind"], p["name"]) for p in listed["pins"]] == [("prefix", "tools")]
        assert listed["pinned_pages"] >= 4 and listed["max_pinned_pages"] > 0
        status, tree = await get(url + "/cache/tree?top_k=5")
        assert status == 200 and tree["num_tokens"] >= 64 and tree["num_nodes"] >= 1
        assert any(
            s["pinned"] and s["first_token_ids"] == tools[:8] for s in tree["largest_subtrees"]
        )
        status, body = await post(
            url + "/generate", {"input_ids": tools + [5, 6], "sampling_params": GREEDY}
        )
        assert status == 200 and body["meta_info"]["cached_tokens"] == 64
        assert (await post(url + "/cache/unpin", {"name": "tools"}))[0] == 200
        status, body = await post(url + "/cache/unpin", {"name": "tools"})
        assert status == 404 and body["error"]["param"] == "name"
        assert body["error"]["message"] == "no prefix pin 'tools' in this namespace"

    asyncio.run(go())


def test_session_retention_on_generate_and_the_openai_extra_body(retention_server):
    url = retention_server.url

    async def go():
        body = {
            "input_ids": prompt_ids(4, 40),
            "sampling_params": GREEDY,
            "session_id": "agent-1",
            "retention": {"ttl_s": 120},
            "priority": 2,
        }
        assert (await post(url + "/generate", body))[0] == 200
        completion = {
            "model": "tiny",
            "prompt": prompt_ids(5, 40),
            "max_tokens": 4,
            "session_id": "agent-2",
            "retention": {"ttl_s": 120},
        }
        status, answer = await post(url + "/v1/completions", completion)
        assert status == 200, answer
        message = {  # Anthropic's Messages API takes the same request options
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "Carry on with the plan."}],
            "session_id": "agent-3",
            "retention": {"ttl_s": 120},
        }
        status, answer = await post(url + "/v1/messages", message)
        assert status == 200, answer
        pins = (await get(url + "/cache/sessions"))[1]["pins"]
        sessions = {p["name"]: p for p in pins if p["kind"] == "session"}
        assert set(sessions) >= {"agent-1", "agent-2", "agent-3"}
        assert 0 < sessions["agent-1"]["expires_in_s"] <= 120
        assert (await post(url + "/cache/unpin", {"session_id": "agent-3"}))[0] == 200
        status, metrics = await get(url + "/metrics")
        assert status == 200 and "radixserve:num_pins 2.0" in metrics
        assert "radixserve:pins_degraded_total" in metrics
        assert (await post(url + "/cache/unpin", {"session_id": "agent-1"}))[0] == 200
        assert (await post(url + "/cache/unpin", {"session_id": "agent-2"}))[0] == 200
        status, body = await post(url + "/cache/unpin", {"session_id": "agent-2"})
        assert status == 404 and body["error"]["param"] == "session_id"
        assert body["error"]["message"] == "no session pin 'agent-2' in this namespace"

    asyncio.run(go())


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/cache/pin", {"input_ids": [1, 2, 3]}, "name"),
        ("/cache/pin", {"input_ids": [1, 2, 3], "name": "x", "ttl_s": -1}, "ttl_s"),
        ("/cache/pin", {"input_ids": [1, 2, 3], "name": "x", "colour": 1}, "colour"),
        ("/cache/unpin", {}, "name"),
        ("/generate", {"input_ids": [1, 2], "retention": {"ttl_s": 5}}, None),
    ],
)
def test_bad_cache_requests_are_400(retention_server, path, body, param):
    status, answer = asyncio.run(post(retention_server.url + path, body))
    assert status == 400, answer
    if param is not None:
        assert answer["error"]["param"] == param


def test_tree_top_k_is_checked(retention_server):
    status, answer = asyncio.run(get(retention_server.url + "/cache/tree?top_k=0"))
    assert status == 400 and answer["error"]["param"] == "top_k"
