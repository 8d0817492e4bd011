"""The Responses API's parts in process: the bounded store (TtlStore, ResponseStore's
owners), the output items' stream events and rendering the input (the server tests:
test_server_responses.py)."""

from __future__ import annotations

import re

import pytest
from tool_call_data import TOOL_TEMPLATE

from conftest import VOCAB
from radixserve.model.tokenizer import open_tokenizer
from radixserve.server.chat_prompt import render_chat
from radixserve.server.errors import BadRequest
from radixserve.server.openai_response import Delta
from radixserve.server.responses_output import OutputItems
from radixserve.server.responses_protocol import parse_responses_request
from radixserve.server.responses_store import ResponseStore, StoredResponse
from radixserve.server.tool_calls import ToolCall, ToolCallDelta
from radixserve.server.ttl_cache import TtlStore

# ---- in process: the bounded store -------------------------------------------------------


def test_ttl_store_bounds_count_bytes_and_age():
    now = [0.0]
    store = TtlStore(ttl_s=10, max_entries=3, max_bytes=100, clock=lambda: now[0])
    for key in "abc":
        assert store.put(key, key.upper(), 30)
    assert store.put("d", "D", 30) and store.get("a") is None  # the 4th drops the oldest
    assert store.put("e", "E", 60) and len(store) == 2 and store.num_bytes == 90  # bytes
    assert not store.put("f", "F", 101) and store.get("f") is None  # alone over the budget
    now[0] = 10.0
    assert store.get("d") is None and store.pop("e") is None and store.num_bytes == 0
    store.put("g", "G", 1)
    assert len(store) == 1 and store.num_bytes == 1  # expired entries swept on put


def test_ttl_store_groups_share_the_bounds_fairly():
    store = TtlStore(ttl_s=10, max_entries=4, max_bytes=100, group_of=lambda key: key[0])
    for i in range(4):
        assert store.put(("a", i), i, 10)  # one group alone fills the count
    for i in range(3):  # b takes places back from the group holding the most
        store.put(("b", i), i, 10)
    kept = [key for key in [*(("a", i) for i in range(4)), *(("b", i) for i in range(3))]
            if store.get(key) is not None]  # fmt: skip
    assert kept == [("a", 2), ("a", 3), ("b", 1), ("b", 2)]  # a's oldest went, then b's own
    assert store.put(("c", 0), 0, 70)  # bytes: 40 held, 70 more: the largest group gives way
    assert store.get(("c", 0)) == 0 and store.num_bytes <= 100 and len(store) <= 4
    assert store.get(("a", 2)) is None and store.get(("b", 2)) is not None


def test_response_store_scopes_by_owner():
    store = ResponseStore(ttl_s=60, max_entries=10, max_bytes=1 << 20)
    record = StoredResponse({"id": "resp_1"}, [], [])
    store.put(("user", "a"), record)
    assert store.get(("user", "a"), "resp_1") is record
    for other in (("user", None), ("admin", "a"), (None, "a")):
        assert store.get(other, "resp_1") is None and not store.delete(other, "resp_1")
    assert store.delete(("user", "a"), "resp_1") and len(store) == 0


def test_output_items_and_their_events_in_order():
    items = OutputItems()
    first = [ToolCallDelta(0, "call_a", "add", '{"a": 1'), ToolCallDelta(0, None, None, "}")]
    events = items.add(Delta("Sure.", [], None, [], first))
    events += items.add(Delta("", [], None, [ToolCall(0, "call_a", "add", '{"a": 1}')]))
    events += items.add(Delta(" Done", [], "tool_calls")) + items.close()
    assert [(e["type"].removeprefix("response."), e["output_index"]) for e in events] == [
        ("output_item.added", 0),
        ("content_part.added", 0),
        ("output_text.delta", 0),
        ("output_text.done", 0),
        ("content_part.done", 0),
        ("output_item.done", 0),
        ("output_item.added", 1),
        ("function_call_arguments.delta", 1),
        ("function_call_arguments.delta", 1),
        ("function_call_arguments.done", 1),
        ("output_item.done", 1),
        ("output_item.added", 2),
        ("content_part.added", 2),
        ("output_text.delta", 2),
        ("output_text.done", 2),
        ("content_part.done", 2),
        ("output_item.done", 2),
    ]
    assert events[6]["item"]["arguments"] == "" and events[6]["item"]["status"] == "in_progress"
    call = items.items[1]
    assert call | {"id": "fc"} == {
        "type": "function_call",
        "id": "fc",
        "call_id": "call_a",
        "name": "add",
        "arguments": '{"a": 1}',
        "status": "completed",
    }
    assert [item["type"] for item in items.items] == ["message", "function_call", "message"]
    assert all(item["status"] == "completed" for item in items.items)


# ---- in process: rendering the input -----------------------------------------------------


def test_input_too_deep_for_the_template_is_a_400_naming_input():
    """A template that renders tool calls gets their arguments as objects; transformers walks
    them recursively, which nesting past the recursion limit broke with a 500."""
    tokenizer = open_tokenizer(None, VOCAB, "tiny")
    tokenizer.chat_template = TOOL_TEMPLATE
    arguments: dict = {}
    for _ in range(2000):
        arguments = {"a": arguments}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    messages = [{"role": "user", "content": "hi"}, turn]
    with pytest.raises(BadRequest) as info:
        render_chat(tokenizer, messages, {}, param="input")
    assert info.value.param == "input" and "input" in str(info.value)


@pytest.mark.parametrize(
    "item, param",
    [
        ({"role": ["user"], "content": "hi"}, "input[0].role"),
        ({"type": {"a": 1}, "role": "user", "content": "hi"}, "input[0].type"),
        (
            {"role": "user", "content": [{"type": ["input_text"], "text": "hi"}]},
            "input[0].content[0].type",
        ),
    ],
)
def test_a_list_or_object_for_a_type_name_is_a_400(item, param):
    """Such values were looked up in dicts of known names: unhashable, a 500."""
    with pytest.raises(BadRequest) as info:
        parse_responses_request({"model": "m", "input": [item]})
    assert info.value.param == param


@pytest.mark.parametrize(
    "extra, refused",
    [
        ({"service_tier": "default", "top_logprobs": 0, "background": None}, None),
        ({"top_logprobs": False}, "'top_logprobs' is not supported by this server"),
        ({"": 1}, "'' is not a known field"),
    ],
)
def test_fields_accepted_only_at_values_that_change_nothing(extra, refused):
    body = {"model": "m", "input": "hi"} | extra
    if refused is None:
        parse_responses_request(body)
        return
    with pytest.raises(BadRequest, match=re.escape(refused)) as info:
        parse_responses_request(body)
    assert info.value.param == next(iter(extra))
