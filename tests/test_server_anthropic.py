"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), driven by the official
`anthropic` SDK against the shared `radixserve serve` on a tiny random Llama (SmolLM2's
tokenizer and chat template), plus the conversion and block building in process."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import anthropic
import jsonschema
import pytest
from tool_call_data import ADD

from conftest import API_KEY
from radixserve.server.anthropic_protocol import parse_messages_request
from radixserve.server.anthropic_response import ContentBlocks
from radixserve.server.errors import BadRequest
from radixserve.server.openai_response import Delta
from radixserve.server.tool_calls import ToolCall

MODEL = "tiny"
# A random model may sample EOS; lengths stay exact without it. The SDK no longer takes
# sampling arguments (the API still does): greedy goes in the body.
GREEDY = {"ignore_eos": True, "temperature": 0}
TOOLS = [{"name": "add", "description": "Adds two integers", "input_schema": ADD}]
MARK = {"type": "ephemeral"}
QUESTION = [{"role": "user", "content": "What is 1 + 2?"}]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


def create(client, **kwargs):
    kwargs = {
        "model": MODEL,
        "max_tokens": 6,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Hi there"}],
    } | kwargs
    return client.messages.create(**kwargs)


def post(url: str, path: str, body: Any, headers: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | (headers or {})
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def count(client, **kwargs) -> int:
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]} | kwargs
    return client.messages.count_tokens(**kwargs).input_tokens


def prompt_total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


# ---- create and count --------------------------------------------------------------------


def test_create_shape_usage_and_count_tokens(client, server):
    message = create(client, system="Be brief.")
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_") and message.stop_reason == "max_tokens"
    [block] = message.content
    assert block.type == "text" and block.text and message.stop_sequence is None
    assert message.usage.output_tokens == 6
    counted = count(client, system="Be brief.")
    assert prompt_total(message.usage) == counted
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    _, tokens = post(server.url, "/tokenize", {"messages": chat})
    assert counted == tokens["count"]  # the same chat template, the same prompt


def test_system_blocks_and_metadata_are_accepted(client):
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    sampling = GREEDY | {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 1}
    message = create(client, system=system, metadata={"user_id": "u-1"}, extra_body=sampling)
    assert message.stop_reason == "max_tokens"
    assert count(client, system=system) > count(client, system="Be brief.")


def test_stop_sequence_ends_the_message_and_is_named(client):
    text = create(client, max_tokens=16).content[0].text
    stop = text[len(text) // 2 :][:2]
    message = create(client, max_tokens=16, stop_sequences=["\x00never", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]


def test_tenants_namespace_their_cache_by_header_or_cache_salt(client):
    """A Messages request's namespace: X-Cache-Salt or the body's cache_salt, as on the
    other chat APIs: one tenant's cached system prompt is never another's hit."""
    system = "You keep the accounts of a small lighthouse, tersely. " * 20

    def cached(headers=None, body=None) -> int:
        extra = GREEDY | (body or {})
        reply = create(client, system=system, max_tokens=2, extra_body=extra, extra_headers=headers)
        return reply.usage.cache_read_input_tokens

    cached({"X-Cache-Salt": "tenant-a"})
    assert cached({"X-Cache-Salt": "tenant-b"}) == 0 and cached() == 0
    assert cached({"X-Cache-Salt": "tenant-a"}) > 200
    assert cached(body={"cache_salt": "tenant-a"}) > 200  # the same namespace
    with pytest.raises(anthropic.BadRequestError):  # the two must agree
        cached({"X-Cache-Salt": "tenant-a"}, {"cache_salt": "tenant-b"})


def test_cache_read_and_creation_on_a_repeated_cached_system_prompt(client):
    text = "You answer as a terse ship's log keeper. " * 25
    system = [{"type": "text", "text": text, "cache_control": MARK}]
    # A user turn longer than a page, so the cached pages of a repeat cover the breakpoint.
    ask = [{"role": "user", "content": "Summarise the entries of the last three days, " * 4}]
    first = create(client, system=system, messages=ask, max_tokens=2).usage
    second = create(client, system=system, messages=ask, max_tokens=2).usage
    assert first.cache_creation_input_tokens > 200  # written at the breakpoint
    assert second.cache_read_input_tokens > 200 and second.cache_creation_input_tokens == 0
    total = count(client, system=system, messages=ask)
    assert prompt_total(first) == prompt_total(second) == total
    plain = create(client, system=text, messages=ask, max_tokens=2).usage
    assert plain.cache_creation_input_tokens == 0 and plain.cache_read_input_tokens > 200
    # A top-level marker covers the whole prompt: all of a new one is written.
    new = [{"role": "user", "content": "Log the storm of the night before, " * 4}]
    marked = create(client, system=text, messages=new, max_tokens=2, cache_control=MARK).usage
    assert marked.cache_creation_input_tokens > 10
    assert marked.input_tokens <= 8  # only the template's generation prompt follows the block


# ---- streaming ---------------------------------------------------------------------------


def test_stream_text_matches_the_whole_message(client):
    whole = create(client, max_tokens=12)
    kwargs = {
        "model": MODEL,
        "max_tokens": 12,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Hi there"}],
    }
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert prompt_total(final.usage) == prompt_total(whole.usage)


def test_stream_event_sequence(client):
    events = list(create(client, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens > 0 and events[0].message.content == []
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6


# ---- tools -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(client, stream):
    choice = {"type": "tool", "name": "add", "disable_parallel_tool_use": True}
    kwargs = {"tools": TOOLS, "tool_choice": choice, "max_tokens": 64, "messages": QUESTION}
    if stream:
        with client.messages.stream(model=MODEL, extra_body=GREEDY, **kwargs) as events:
            kinds = [event.type for event in events]
            message = events.get_final_message()
        assert "input_json" in kinds  # the SDK's event for an input_json_delta
    else:
        message = create(client, **kwargs)
    assert message.stop_reason == "tool_use"
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "add" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, ADD)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "3"}
    thanks = {"type": "text", "text": "Thanks."}
    history = [
        *QUESTION,
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [result, thanks]},
    ]
    answer = create(client, tools=TOOLS, messages=history, max_tokens=4)
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert answer.usage.cache_read_input_tokens > 0  # the tools prompt is a cached prefix

    def counted(block: dict) -> int:
        return count(
            client, tools=TOOLS, messages=[*history[:2], {"role": "user", "content": [block]}]
        )

    assert counted(result | {"is_error": True}) > counted(result)  # the model sees the error


def test_any_tool_choice_forces_a_call(client):
    message = create(
        client,
        tools=TOOLS,
        tool_choice={"type": "any"},
        max_tokens=64,
        extra_body={"temperature": 1.0, "seed": 3},
    )
    assert message.stop_reason == "tool_use"
    jsonschema.validate(message.content[-1].input, ADD)


def test_tool_choice_none_leaves_the_tools_out(client):
    assert count(client, tools=TOOLS, tool_choice={"type": "none"}) == count(client)
    assert count(client, tools=TOOLS) > count(client) + 20


# ---- errors ------------------------------------------------------------------------------

BASE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "body, field",
    [
        ({k: v for k, v in BASE.items() if k != "max_tokens"}, "max_tokens"),
        (BASE | {"max_tokens": 0}, "max_tokens"),
        (BASE | {"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
        (
            BASE | {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0].type",
        ),
        (
            BASE | {"messages": [{"role": "user", "content": [{"type": "nope"}]}]},
            "messages[0].content[0].type",
        ),
        (BASE | {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (  # a list or an object where a type name goes was a 500 (no dict key)
            BASE | {"messages": [{"role": "user", "content": [{"type": ["text"]}]}]},
            "messages[0].content[0].type",
        ),
        (BASE | {"tool_choice": {"type": {"a": 1}}, "tools": TOOLS}, "tool_choice"),
        (BASE | {"tool_choice": {"type": "sometimes"}, "tools": TOOLS}, "tool_choice"),
        (BASE | {"tool_choice": {"type": "tool", "name": "mul"}, "tools": TOOLS}, "tool_choice"),
        (BASE | {"tool_choice": {"type": "any"}}, "tool_choice"),
        (BASE | {"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"),
        (BASE | {"temperature": 1.5}, "temperature"),
        (BASE | {"stop_sequences": "END"}, "stop_sequences"),
        (BASE | {"frequency_penalty": 1}, "frequency_penalty"),
        (
            BASE | {"system": [{"type": "text", "text": "x", "cache_control": {"type": "x"}}]},
            "system[0].cache_control",
        ),
        (BASE | {"max_tokens": 100000}, "max_tokens"),
    ],
)
def test_bad_input_is_a_400_in_anthropics_shape(server, body, field):
    status, error = post(server.url, "/v1/messages", body)
    assert status == 400 and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]


def test_sdk_raises_bad_request_and_not_found(client):
    bad = [{"role": "robot", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages=bad)
    assert info.value.status_code == 400 and "messages[0].role" in info.value.message
    with pytest.raises(anthropic.NotFoundError) as info:
        create(client, model="claude-imaginary")
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[])


def test_x_api_key_is_accepted_and_checked(keyed_server):
    models = urllib.request.Request(keyed_server.url + "/v1/models")
    models.add_header("Authorization", f"Bearer {API_KEY}")
    with urllib.request.urlopen(models) as response:
        name = json.loads(response.read())["data"][0]["id"]
    body = {"model": name, "messages": BASE["messages"]}
    url, path, headers = keyed_server.url, "/v1/messages/count_tokens", {"anthropic-version": "1"}
    status, error = post(url, path, body, headers)
    assert status == 401 and error["error"]["type"] == "authentication_error"
    assert post(url, path, body, headers | {"x-api-key": "wrong"})[0] == 401
    status, counted = post(url, path, body, headers | {"x-api-key": API_KEY})
    assert status == 200 and counted["input_tokens"] > 0
    sdk = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)  # sends Bearer
    assert sdk.messages.count_tokens(**body).input_tokens == counted["input_tokens"]


# ---- in process: conversion and blocks ---------------------------------------------------


@pytest.mark.parametrize(
    "extra, refused",
    [
        ({"service_tier": "auto"}, None),
        ({"service_tier": None}, None),
        ({"service_tier": "priority"}, "'service_tier' is not supported by this server"),
        ({"": 1}, "'' is not a known field"),
        ({"bogus": True}, "'bogus' is not a known field"),
    ],
)
def test_fields_accepted_only_at_values_that_change_nothing(extra, refused):
    if refused is None:
        parse_messages_request(BASE | extra)
        return
    with pytest.raises(BadRequest, match=re.escape(refused)) as info:
        parse_messages_request(BASE | extra)
    assert info.value.param == next(iter(extra))


def test_blocks_become_chat_messages_in_order():
    body = BASE | {
        "system": [
            {"type": "text", "text": "A"},
            {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "add"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Sure."},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "is_error": True,
                        "content": [{"type": "text", "text": "overflow"}],
                    },
                    {"type": "text", "text": "again"},
                ],
            },
            {"role": "assistant", "content": "The sum is"},
        ],
    }
    parsed = parse_messages_request(body)
    roles = ["system", "user", "assistant", "tool", "user", "assistant"]
    assert [m["role"] for m in parsed.messages] == roles
    assert parsed.messages[0]["content"] == "A\nB"
    call = parsed.messages[2]["tool_calls"][0]
    assert call["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert parsed.messages[3] == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "Error: overflow",
    }
    assert parsed.breakpoint_messages == [{"role": "system", "content": "A\nB"}]
    assert parsed.template_kwargs["continue_final_message"]  # a prefilled reply continues
    assert parsed.tool_choice.mode == "auto" and parsed.sampling["max_new_tokens"] == 4


def test_content_blocks_and_their_events():
    blocks = ContentBlocks()
    call = ToolCall(0, "call_ab", "add", '{"a": 1, "b": 2}')
    events = blocks.add(Delta("Sure.", [], None, [call]))
    events += blocks.add(Delta(" Done", [], "tool_calls"))
    events += blocks.close()
    assert [(name, data.get("index")) for name, data in events] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
    ]
    assert blocks.blocks[1] == {
        "type": "tool_use",
        "id": "toolu_ab",
        "name": "add",
        "input": {"a": 1, "b": 2},
    }
    assert [b.get("text") for b in blocks.blocks] == ["Sure.", None, " Done"]
    empty = ContentBlocks()
    assert [name for name, _ in empty.close()] == ["content_block_start", "content_block_stop"]
    assert empty.blocks == [{"type": "text", "text": ""}]
