"""An assistant turn's past reasoning, sent back by the client, reaches the chat template on
every chat API: chat completions' `reasoning_content` (and vLLM's `reasoning`), Anthropic's
thinking blocks, the Responses API's reasoning items. A template that keeps it (Qwen3's,
after the last user turn) renders it; SmolLM2's ignores it."""

from __future__ import annotations

import pytest
from tool_call_data import HISTORY, MODEL

from conftest import VOCAB
from radixserve.model.tokenizer import open_tokenizer
from radixserve.server.anthropic_protocol import parse_messages_request
from radixserve.server.chat_messages import check_messages
from radixserve.server.chat_prompt import render_chat
from radixserve.server.errors import BadRequest
from radixserve.server.responses_items import chat_messages, check_input, seal_reasoning

THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}|{% endfor %}"
)
"""Renders each turn's reasoning before its content, as Qwen3's template does after the last
user turn (calls reach it as text: it renders no tools)."""


@pytest.fixture
def thinking_tokenizer():
    tokenizer = open_tokenizer(None, VOCAB, MODEL)
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def test_chat_reasoning_reaches_the_template_under_either_name(thinking_tokenizer):
    for key in ("reasoning_content", "reasoning"):
        messages = check_messages([*HISTORY[:2], {"role": "tool", "tool_call_id": "call_1",
                                   "content": "3"}])  # fmt: skip
        messages[1] = check_messages([HISTORY[1] | {key: "add them"}])[0]
        text = render_chat(thinking_tokenizer, messages, {"add_generation_prompt": False})
        assert "assistant: <think>add them</think><tool_call>" in text
    same = {"reasoning": "x", "reasoning_content": "x"}
    assert check_messages([{"role": "assistant", "content": "a"} | same])[0]["thinking"] == "x"
    for bad, field in [({"reasoning": "x", "reasoning_content": "y"}, "messages[0].reasoning"),
                       ({"reasoning_content": 5}, "messages[0].reasoning_content")]:  # fmt: skip
        with pytest.raises(BadRequest) as caught:
            check_messages([{"role": "assistant", "content": "a"} | bad])
        assert caught.value.param == field
    with pytest.raises(BadRequest, match="reasoning_content"):
        check_messages([{"role": "user", "content": "a", "reasoning_content": "x"}])


def test_anthropic_thinking_blocks_become_the_turns_reasoning(thinking_tokenizer):
    use = {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}
    body = {
        "model": "m", "max_tokens": 8,
        "tools": [{"name": "add", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "What is 1 + 2?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should add.", "signature": ""},
                {"type": "redacted_thinking", "data": "opaque"}, use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "3"}]},
        ],
    }  # fmt: skip
    messages = parse_messages_request(body).messages
    assert messages[1]["reasoning_content"] == "I should add." and messages[1]["tool_calls"]
    text = render_chat(thinking_tokenizer, messages, {"add_generation_prompt": False})
    assert "assistant: <think>I should add.</think><tool_call>" in text
    body["messages"][1]["content"][0]["thinking"] = 5
    with pytest.raises(BadRequest, match=r"messages\[1\]\.content\[0\]\.thinking"):
        parse_messages_request(body)


def test_responses_reasoning_items_join_the_next_assistant_turn(thinking_tokenizer):
    def reasoning(text):
        return {"type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip

    def call(call_id):
        return {"type": "function_call", "call_id": call_id, "name": "add",
                "arguments": '{"a": 1}'}  # fmt: skip

    items = check_input([
        {"role": "user", "content": "What is 1 + 2?"},
        reasoning("First add."), call("c1"), reasoning("Then check."), call("c2"),
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        reasoning("lost"), {"role": "user", "content": "thanks"},
    ])  # fmt: skip
    messages = chat_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1]["reasoning_content"] == "First add.\nThen check."
    assert "reasoning_content" not in messages[3]  # reasoning before a user turn: dropped
    with pytest.raises(BadRequest, match=r"input\[0\]\.content"):
        check_input([{"type": "reasoning", "summary": [], "content": [{"type": "x"}]}])


def test_chat_completions_accept_an_assistant_turns_reasoning(openai_client):
    messages = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "3", "reasoning_content": "1 + 2 = 3."},
        {"role": "user", "content": "And 2 + 2?"},
    ]
    reply = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    again = openai_client.chat.completions.create(model="tiny", messages=plain, max_tokens=2)
    assert reply.usage.prompt_tokens == again.usage.prompt_tokens  # SmolLM2's drops it


def test_sealed_reasoning_opens_into_the_next_assistant_turn():
    parts = [{"type": "reasoning_text", "text": "Add 1 and 2."}]
    sealed = seal_reasoning(parts)
    assert sealed.startswith("rsv1:") and "Add 1" not in sealed
    items = check_input([
        {"role": "user", "content": "What is 1 + 2?"},
        {"type": "reasoning", "summary": [], "encrypted_content": sealed},
        {"role": "assistant", "content": "3"},
    ])  # fmt: skip
    assert items[1]["content"] == parts
    assert chat_messages(items)[1]["reasoning_content"] == "Add 1 and 2."
    for bad in ("gAAAAABotherserver", "rsv1:!!!", seal_reasoning([{"type": "x", "text": "y"}])):
        with pytest.raises(BadRequest) as caught:
            check_input([{"type": "reasoning", "summary": [], "encrypted_content": bad}])
        assert caught.value.param == "input[0].encrypted_content"
