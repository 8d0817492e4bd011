"""OpenAI's Conversations API (/v1/conversations and its items) through the `openai` client,
and the OpenAI Agents SDK's OpenAIConversationsSession keeping an agent's history in it, on
the shared server."""

from __future__ import annotations

import asyncio
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

MODEL = "tiny"


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def test_conversation_items_create_list_page_and_delete(client):
    conversation = client.conversations.create(items=[user("Hi")], metadata={"agent": "a1"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"agent": "a1"}
    added = client.conversations.items.create(
        conversation.id, items=[user(f"turn {i}") for i in range(5)]
    )
    assert len(added.data) == 5 and all(item.id for item in added.data)
    newest = client.conversations.items.list(conversation.id, limit=2)  # desc by default
    assert [i.content[0].text for i in newest.data] == ["turn 4", "turn 3"] and newest.has_more
    everything = list(client.conversations.items.list(conversation.id, order="asc", limit=2))
    assert [i.content[0].text for i in everything] == ["Hi"] + [f"turn {i}" for i in range(5)]
    first = everything[0]
    assert client.conversations.items.retrieve(first.id, conversation_id=conversation.id).id
    client.conversations.items.delete(first.id, conversation_id=conversation.id)
    assert len(list(client.conversations.items.list(conversation.id))) == 5
    updated = client.conversations.update(conversation.id, metadata={"agent": "a2"})
    assert updated.metadata == {"agent": "a2"}
    other = client.with_options(default_headers={"X-Cache-Salt": "tenant-b"})
    with pytest.raises(openai.NotFoundError):
        other.conversations.retrieve(conversation.id)  # another tenant's: not found
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)


def test_bad_items_and_bounds_are_400s_naming_the_field(client):
    conversation = client.conversations.create()
    for items, field in [([{"type": "message", "role": "nobody", "content": "x"}], "items[0]"),
                         ([user("x")] * 21, "items"), ([], "items"),
                         ("hi", "items")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as caught:
            client.conversations.items.create(conversation.id, items=items)
        assert caught.value.param.startswith(field)


def test_agents_sdk_session_keeps_the_history_between_runs(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="chat",
        instructions="Answer yes or no.",
        output_type=Verdict,  # a schema ends the random model's answer in time
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=64),
    )
    session = agents.OpenAIConversationsSession(openai_client=client)

    async def two_turns():
        first = await agents.Runner.run(agent, "Is the sky blue?", session=session)
        second = await agents.Runner.run(agent, "And the grass?", session=session)
        return first, second, await session.get_items()

    first, second, items = asyncio.run(two_turns())
    roles = [item.get("role") for item in items if item.get("type", "message") == "message"]
    assert roles[:2] == ["user", "assistant"] and roles[2:] == ["user", "assistant"]
    grown = second.raw_responses[0].usage.input_tokens - first.raw_responses[0].usage.input_tokens
    assert grown > 0  # the second run's prompt carries the first run's turn


def test_a_response_in_a_conversation_continues_it_and_joins_it(client):
    conversation = client.conversations.create(items=[user("My name is Ada.")])
    ask = {"model": MODEL, "input": "What is my name?", "max_output_tokens": 4}
    response = client.responses.create(**ask, conversation=conversation.id)
    assert response.conversation.id == conversation.id
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    assert [i.type for i in items][:2] == ["message", "message"]
    assert items[1].content[0].text == "What is my name?" and len(items) == 3  # + the answer
    alone = client.responses.create(**ask)
    assert response.usage.input_tokens > alone.usage.input_tokens  # the history came first
    for extra, status in [({"previous_response_id": alone.id}, 400), ({}, 404)]:
        target = conversation.id if extra else "conv_missing"
        with pytest.raises(openai.APIStatusError) as caught:
            client.responses.create(model=MODEL, input="x", conversation=target, **extra)
        assert caught.value.status_code == status
        assert caught.value.body["param"] == "conversation"
