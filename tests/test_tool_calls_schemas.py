"""A request's tools and tool_choice are checked naming the field (no server), and the schema
that forces a call allows exactly the tools' calls."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar
from tool_call_data import ADD, TOOLS

from radixserve.server.errors import BadRequest
from radixserve.server.tool_calls import call_schema, check_tool_choice, check_tools


@pytest.mark.parametrize(
    "tools",
    [
        {"type": "function"},
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"name": "has space"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
        [{"type": "function", "function": {"name": "f", "extra": 1}}],
        [{"type": "function", "function": {"name": "f"}}] * 2,
    ],
)
def test_bad_tools_name_the_field(tools):
    with pytest.raises(BadRequest) as exc:
        check_tools(tools)
    assert exc.value.param == "tools"


@pytest.mark.parametrize(
    "choice", ["always", {"type": "function", "function": {"name": "mul"}}, {"type": "function"}]
)
def test_bad_tool_choice_names_the_field(choice):
    with pytest.raises(BadRequest) as exc:
        check_tool_choice(choice, check_tools(TOOLS))
    assert exc.value.param == "tool_choice"


def test_tool_choice_defaults():
    assert check_tool_choice(None, check_tools(TOOLS)).mode == "auto"
    assert check_tool_choice(None, []).mode == "none"
    assert check_tool_choice("auto", []).mode == "none"
    assert check_tools([{"type": "function", "function": {"name": "f"}}])[0]["function"][
        "parameters"
    ] == {"type": "object", "properties": {}, "additionalProperties": False}


def test_call_schema_allows_exactly_the_tools_calls():
    schema = call_schema(check_tools(TOOLS))
    assert [case["properties"]["name"] for case in schema["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "add"},
    ]
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": -2}}, schema)
    for bad in ({"name": "add", "arguments": {"a": 1}}, {"name": "mul", "arguments": {}},
                {"name": "add", "arguments": {"a": 1, "b": 2}, "x": 0}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    xgrammar.Grammar.from_json_schema(json.dumps(schema))  # compiles


def test_call_schema_of_a_named_tool():
    schema = call_schema(check_tools(TOOLS), "add")
    assert schema["properties"] == {"name": {"const": "add"}, "arguments": ADD}
    assert schema["required"] == ["name", "arguments"]
