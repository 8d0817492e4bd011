"""Tools and tool-call turns in the chat prompt (no server): SmolLM2's template gets the tools
in a system prompt and calls and results as tagged text; a template that renders tools gets
them as they are."""

from __future__ import annotations

import json

import pytest
from tool_call_data import CALL, HISTORY, MODEL, TOOL_TEMPLATE, TOOLS

from conftest import VOCAB
from radixserve.model.tokenizer import open_tokenizer
from radixserve.server.chat_messages import check_messages
from radixserve.server.chat_prompt import plain_tool_messages, render_chat, template_renders_tools
from radixserve.server.tool_calls import check_tools


@pytest.fixture(scope="module")
def tokenizer():
    return open_tokenizer(None, VOCAB, MODEL)  # SmolLM2's, as the server fixture uses


@pytest.fixture
def tool_tokenizer(tokenizer):
    """SmolLM2's tokenizer with a template that renders tools, as Qwen's or Llama 3.1's do."""
    original = tokenizer.chat_template
    tokenizer.chat_template = TOOL_TEMPLATE
    yield tokenizer
    tokenizer.chat_template = original


def test_smollm_template_gets_tools_in_a_system_prompt(tokenizer):
    assert not template_renders_tools(tokenizer)
    text = render_chat(tokenizer, [{"role": "user", "content": "Hi"}], {}, check_tools(TOOLS))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    lines = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in lines] == check_tools(TOOLS)
    assert '<tool_call>{"name": <function-name>, "arguments": <arguments-json-object>}' in system
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_tools_prompt_joins_an_existing_system_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    converted = plain_tool_messages(messages, check_tools(TOOLS))
    assert len(converted) == 2 and converted[0]["content"].startswith("Be brief.\n\n# Tools")


def test_history_calls_and_results_become_tagged_text(tokenizer):
    history = check_messages([*HISTORY, {"role": "tool", "tool_call_id": "c2", "content": "4"}])
    text = render_chat(tokenizer, history, {})
    assert f"<|im_start|>assistant\n<tool_call>{CALL}</tool_call><|im_end|>" in text
    results = "<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n" in text
    assert "# Tools" not in text  # no tools offered


def test_messages_keep_tool_fields_and_accept_empty_tool_calls():
    checked = check_messages([*HISTORY, {"role": "assistant", "content": "3", "tool_calls": []}])
    assert checked[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": {"a": 1, "b": 2}},
            }
        ],
    }
    assert checked[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    assert checked[3] == {"role": "assistant", "content": "3"}


def test_a_tool_template_gets_tools_and_turns_as_they_are(tool_tokenizer):
    assert template_renders_tools(tool_tokenizer)
    text = render_chat(tool_tokenizer, check_messages(HISTORY), {}, check_tools(TOOLS))
    assert text.startswith("TOOLS:get_weather;add;|user: What is 1 + 2?|")
    assert text.endswith('|assistant: CALL add{"a": 1, "b": 2}|tool: 3|')
    assert "<tool_call>" not in text
