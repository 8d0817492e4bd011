"""Tool calls parsed out of the model's text (no server): `<tool_call>` blocks and bare JSON
calls become calls, anything malformed stays content, and the streamed parse matches the
whole one."""

from __future__ import annotations

import json
import re

import pytest
from tool_call_data import CALL, NAMES

from radixserve.server.tool_calls import ToolCallParser, parse_tool_calls


def test_blocks_become_calls_and_the_rest_content():
    parsed = parse_tool_calls(f"Let me add.\n<tool_call>{CALL}</tool_call>\n", NAMES)
    assert parsed.content == "Let me add."
    [call] = parsed.calls
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "add", {"a": 1, "b": 2})
    assert re.fullmatch(r"call_[0-9a-f]{32}", call.id)


def test_several_blocks_keep_their_order_and_the_text_between():
    weather = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = f"<tool_call>\n{CALL}\n</tool_call> and <tool_call>{weather}</tool_call> done"
    parsed = parse_tool_calls(text, NAMES)
    assert [(c.index, c.name) for c in parsed.calls] == [(0, "add"), (1, "get_weather")]
    assert parsed.content == "anddone"


def test_a_bare_json_call_is_a_call():
    parsed = parse_tool_calls(f"  {CALL}\n", NAMES)
    assert parsed.content == "" and [c.name for c in parsed.calls] == ["add"]
    assert parse_tool_calls('{"name": "add"}', NAMES).calls[0].arguments == "{}"


def test_raw_control_characters_in_arguments_come_back_escaped():
    # xgrammar lets raw control characters into length-bounded strings; JSON forbids them
    [call] = parse_tool_calls(
        '{"name": "get_weather", "arguments": {"city": "a\x0eb"}}', NAMES
    ).calls
    assert (
        call.arguments == '{"city": "a\\u000eb"}' and json.loads(call.arguments)["city"] == "a\x0eb"
    )


@pytest.mark.parametrize(
    "text",
    [
        "Just an answer.",
        '{"name": "subtract", "arguments": {}}',  # unknown tool
        '{"answer": 3}',  # JSON, but not a call
        f"{CALL} trailing words",  # more than the call
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}, "extra": 1}</tool_call>',
        '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>',
        "<tool_call>" + CALL[:-3],  # cut off mid-call
    ],
)
def test_malformed_calls_stay_content(text):
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.calls == [] and parsed.content == text


def test_an_unclosed_last_block_still_counts():
    parsed = parse_tool_calls(f"<tool_call>{CALL}", NAMES)
    assert parsed.content == "" and [c.name for c in parsed.calls] == ["add"]


@pytest.mark.parametrize(
    "text",
    [
        f"Sure thing.  <tool_call>{CALL}</tool_call>  Anything else?",
        f"{CALL}",
        "a < b and <tool but not a call <tool_call",
        "<tool_call>{bad}</tool_call> then text\n",
        f"x<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>",
    ],
)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_parse_matches_the_whole_parse(text, piece):
    whole = parse_tool_calls(text, NAMES)
    parser, content, calls = ToolCallParser(NAMES), "", []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for i, chunk in enumerate(pieces):
        out = parser.feed(chunk, final=i == len(pieces) - 1)
        assert "<tool_call>" not in out.content or not whole.calls
        content, calls = content + out.content, calls + out.calls
    assert content == whole.content
    assert [(c.index, c.name, c.arguments) for c in calls] == [
        (c.index, c.name, c.arguments) for c in whole.calls
    ]


def test_content_streams_before_the_call_ends():
    parser = ToolCallParser(NAMES)
    assert parser.feed("Adding now. <tool").content == "Adding now."
    assert parser.feed('_call>{"name": "add", ').content == ""
    out = parser.feed('"arguments": {}}</tool_call>', final=True)
    assert [c.name for c in out.calls] == ["add"] and out.content == ""
