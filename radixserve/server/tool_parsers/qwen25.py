"""Qwen2.5 / Hermes tool calls (SGLang `qwen25`, vLLM `hermes`):

    text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call; an output that starts with such a JSON object is a call too. Forced
(`tool_choice` required or named): one bare JSON call, as before the families existed."""

from __future__ import annotations

import json
from typing import Any

from radixserve.server.tool_parsers.base import (
    CallSink,
    Reader,
    Source,
    ToolFormat,
    json_envelope,
    literal,
)

START, END = "<tool_call>", "</tool_call>"


def read(src: Source, sink: CallSink, marker: str) -> Reader:
    if not (yield from json_envelope(src, sink, ("arguments",))):
        return False
    if marker:
        yield from literal(src, END)
    return True


def call_schema(tools: list[dict[str, Any]], name: str | None = None, key: str = "arguments"):
    """A JSON schema for one call, {"name": NAME, KEY: PARAMETERS}, of any of the tools
    (anyOf) or of just the one named."""
    cases = [_call_case(t["function"], key) for t in tools if name in (None, t["function"]["name"])]
    return cases[0] if len(cases) == 1 else {"anyOf": cases}


def _call_case(function: dict[str, Any], key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, key: function["parameters"]},
        "required": ["name", key],
        "additionalProperties": False,
    }


def forced(tools: list[dict[str, Any]], name: str | None) -> tuple[str, Any]:
    return "json_schema", call_schema(tools, name)


def write_call(name: str, arguments: dict[str, Any]) -> str:
    return f"{START}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{END}"


INSTRUCTION = (
    "To call a function, answer with a JSON object inside <tool_call></tool_call> tags, one "
    'block per call:\n<tool_call>{"name": <function-name>, "arguments": '
    "<arguments-json-object>}</tool_call>"
)

QWEN25 = ToolFormat("qwen25", (START,), read, forced, write_call, INSTRUCTION, bare_start="{")
