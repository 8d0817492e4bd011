"""OpenAI's Responses API (/v1/responses), driven by the official `openai` SDK and the OpenAI
Agents SDK against the shared `radixserve serve` on a tiny random Llama (SmolLM2's tokenizer
and chat template), plus raw HTTP for bad input (the store and output items in process:
test_server_responses_units.py).

The model is random: a test that needs a call or a finished message forces it (tool_choice,
a bounded JSON schema); lengths stay exact with `ignore_eos`."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tool_call_data import ADD

from conftest import ADMIN_API_KEY, API_KEY

MODEL = "tiny"
GREEDY = {"ignore_eos": True}
TOOLS = [
    {
        "type": "function",
        "name": "add",
        "description": "Adds two integers",
        "parameters": ADD,
        "strict": True,
    }
]
FORCE_ADD = {"type": "function", "name": "add"}
ADD_FORMAT = {"type": "json_schema", "name": "add", "schema": ADD, "strict": True}
SALT = "X-Cache-Salt"
CALL_FIELDS = {"type", "id", "call_id", "name", "arguments", "status"}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def create(client, **kwargs):
    kwargs = {
        "model": MODEL,
        "input": "Hi there",
        "max_output_tokens": 6,
        "temperature": 0,
        "extra_body": GREEDY,
    } | kwargs
    return client.responses.create(**kwargs)


def post(url: str, path: str, body: Any, headers: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | (headers or {})
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def num_tokens(url: str, messages: list[dict]) -> int:
    return post(url, "/tokenize", {"messages": messages})[1]["count"]


# ---- create ------------------------------------------------------------------------------


def test_create_shape_usage_and_prompt(client, server):
    response = create(client, instructions="Be brief.", metadata={"run": "1"})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.created_at > 0
    assert response.status == "incomplete"  # ignore_eos: it ran to max_output_tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and response.output_text
    assert response.metadata == {"run": "1"} and response.instructions == "Be brief."
    usage = response.usage
    assert usage.output_tokens == 6 and usage.output_tokens_details.reasoning_tokens == 0
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert usage.input_tokens == num_tokens(server.url, chat)  # the same chat template
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_items_become_the_chat_conversation(client, server):
    items = [
        {"role": "developer", "content": "Be kind."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "A"}, {"type": "input_text", "text": "B"}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "C", "annotations": []}]},
        {"role": "user", "content": "D"},
    ]
    response = create(client, input=items, max_output_tokens=2)
    chat = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "A\nB"},
        {"role": "assistant", "content": "C"},
        {"role": "user", "content": "D"},
    ]
    assert response.usage.input_tokens == num_tokens(server.url, chat)


def test_json_schema_text_format_streams_and_completes(client):
    kwargs = {
        "model": MODEL,
        "input": "Add",
        "max_output_tokens": 64,
        "temperature": 0,
        "text": {"format": ADD_FORMAT},
    }
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == text
    jsonschema.validate(json.loads(text), ADD)
    whole = client.responses.create(**kwargs)  # the same greedy output, not streamed
    assert whole.output_text == text and whole.usage.output_tokens == final.usage.output_tokens


def test_stream_true_ends_incomplete_at_max_output_tokens(client):
    events = list(create(client, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 6


# ---- tools and chaining ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip_chained(client, server, stream):
    kwargs = {
        "model": MODEL,
        "input": "What is 1 + 2?",
        "tools": TOOLS,
        "tool_choice": FORCE_ADD,
        "max_output_tokens": 64,
        "temperature": 0,
    }
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = [event.type for event in events]
            first = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
    else:
        first = client.responses.create(**kwargs)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "add" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "3"}
    second = create(
        client, previous_response_id=first.id, input=[result], tools=TOOLS, max_output_tokens=4
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's KV
    # The chain's prompt: the first turn's input and call, then the result.
    replayed = create(
        client,
        input=[
            {"role": "user", "content": "What is 1 + 2?"},
            call.model_dump(include=CALL_FIELDS),
            result,
        ],
        tools=TOOLS,
        max_output_tokens=4,
    )
    assert second.usage.input_tokens == replayed.usage.input_tokens


def test_chained_text_turn_reuses_the_cache(client, server):
    first = create(client, input="My name is Ada and I keep the lighthouse.", max_output_tokens=8)
    second = create(client, previous_response_id=first.id, input="What is my name?")
    chat = [
        {"role": "user", "content": "My name is Ada and I keep the lighthouse."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == num_tokens(server.url, chat)
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_forced_call_takes_precedence_over_text_format(client):
    response = create(
        client,
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=64,
        text={"format": ADD_FORMAT},
        extra_body={},
    )
    assert [item.type for item in response.output] == ["function_call"]
    jsonschema.validate(json.loads(response.output[0].arguments), ADD)


# ---- stored responses --------------------------------------------------------------------


def test_retrieve_input_items_delete(client):
    response = create(
        client, input=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    )
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    items = client.responses.input_items.list(response.id)
    assert [item.content[0].text for item in items.data] == ["two", "one"]  # newest first
    oldest = client.responses.input_items.list(response.id, order="asc", limit=1)
    assert [item.content[0].text for item in oldest.data] == ["one"] and oldest.has_more
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as info:
        create(client, previous_response_id=response.id)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_store_false_is_not_kept(client):
    response = create(client, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_another_namespace_cannot_read_delete_or_chain(client):
    mine = create(client, extra_body=GREEDY | {"cache_salt": "tenant-a"})
    theirs = {"extra_headers": {SALT: "tenant-b"}}
    for kwargs in ({}, theirs):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(mine.id, **kwargs)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(mine.id, **kwargs)
    with pytest.raises(openai.NotFoundError):
        create(client, previous_response_id=mine.id, extra_body=GREEDY | {"cache_salt": "b"})
    with pytest.raises(openai.NotFoundError):
        create(client, previous_response_id=mine.id)
    own = {"extra_headers": {SALT: "tenant-a"}}
    assert client.responses.retrieve(mine.id, **own).id == mine.id
    chained = create(client, previous_response_id=mine.id, input="More.", **own)
    assert chained.usage.input_tokens_details.cached_tokens > 0


def test_another_key_cannot_read_it(keyed_server):
    def sdk(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=key, max_retries=0)

    user, admin = sdk(API_KEY), sdk(ADMIN_API_KEY)
    mine = user.responses.create(input="Hi", max_output_tokens=2, extra_body=GREEDY)
    assert user.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        admin.responses.retrieve(mine.id)
    with pytest.raises(openai.AuthenticationError):
        sdk("wrong").responses.retrieve(mine.id)


# ---- bad input ---------------------------------------------------------------------------

BASE = {"model": MODEL, "input": "hi", "max_output_tokens": 2}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL}, "input"),
        (BASE | {"input": []}, "input"),
        (BASE | {"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (
            BASE | {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        (BASE | {"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            BASE
            | {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "add", "arguments": "[1]"}
                ]
            },
            "input[0].arguments",
        ),
        (BASE | {"max_output_tokens": 0}, "max_output_tokens"),
        (BASE | {"max_output_tokens": 10**6}, "max_output_tokens"),
        (BASE | {"temperature": 3}, "temperature"),
        (BASE | {"tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            BASE | {"tools": TOOLS, "tool_choice": {"type": "function", "name": "mul"}},
            "tool_choice",
        ),
        (BASE | {"tool_choice": "required"}, "tool_choice"),
        (BASE | {"text": {"format": {"type": "yaml"}}}, "text.format"),
        (
            BASE
            | {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
                }
            },
            "text.format",
        ),
        (BASE | {"metadata": {"k": 1}}, "metadata"),
        (BASE | {"store": "yes"}, "store"),
        (BASE | {"previous_response_id": "resp_nope"}, "previous_response_id"),
        (BASE | {"include": ["message.output_text.logprobs"]}, "include"),
        (BASE | {"truncation": "middle"}, "truncation"),
        (BASE | {"conversation": 5}, "conversation"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(server, body, param):
    status, error = post(server.url, "/v1/responses", body)
    assert status == (404 if param == "previous_response_id" else 400)
    assert error["error"]["param"] == param and error["error"]["message"]


def test_unknown_ids_and_queries(server):
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.url + "/v1/responses/resp_nope")
    assert info.value.code == 404 and json.loads(info.value.read())["error"]["param"]
    status, created = post(server.url, "/v1/responses", BASE)
    url = f"{server.url}/v1/responses/{created['id']}"
    for query in ("?stream=true", "/input_items?limit=0", "/input_items?order=up"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url + query)
        assert info.value.code == 400


# ---- the OpenAI Agents SDK ---------------------------------------------------------------


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]


def test_agents_sdk_runs_an_agent_with_a_tool_for_two_turns(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[tuple[int, int]] = []

    @agents.function_tool
    def add(
        a: Annotated[int, Field(ge=-50, le=50)], b: Annotated[int, Field(ge=-50, le=50)]
    ) -> int:
        """Adds two integers."""
        calls.append((a, b))
        return a + b

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="calculator",
        instructions="Use the add tool, then say whether the sum is positive.",
        tools=[add],
        output_type=Verdict,
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )

    async def two_turns():
        first = await agents.Runner.run(agent, "Is 1 + 2 positive?")
        second = await agents.Runner.run(
            agent, "And 2 + 3?", previous_response_id=first.last_response_id
        )
        return first, second

    first, second = asyncio.run(two_turns())
    assert len(calls) == 2  # one forced call per turn, run by the agent
    assert isinstance(first.final_output, Verdict) and isinstance(second.final_output, Verdict)
    chained = second.raw_responses[0]  # sent with previous_response_id: only the new input
    assert chained.usage.input_tokens_details.cached_tokens > 0
