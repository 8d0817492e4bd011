"""Llama 3.1-3.3 JSON tool calls (SGLang `llama3`, vLLM `llama3_json`):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>`, several calls separated by `;` ("arguments" is read as
well as "parameters"). Forced: one bare `{"name": ..., "parameters": {...}}` object."""

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
from radixserve.server.tool_parsers.qwen25 import call_schema

PYTHON_TAG = "<|python_tag|>"
KEYS = ("parameters", "arguments")


def read(src: Source, sink: CallSink, marker: str) -> Reader:
    while (yield from json_envelope(src, sink, KEYS)):
        if not (yield from literal(src, ";")):
            return True
        yield from literal(src, PYTHON_TAG)
    return False


def forced(tools: list[dict[str, Any]], name: str | None) -> tuple[str, Any]:
    return "json_schema", call_schema(tools, name, key="parameters")


def write_call(name: str, arguments: dict[str, Any]) -> str:
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


INSTRUCTION = """To call a function, answer with only a JSON object (several separated by ";"):
{"name": <function-name>, "parameters": <arguments-json-object>}"""

LLAMA3 = ToolFormat("llama3", (PYTHON_TAG,), read, forced, write_call, INSTRUCTION, bare_start="{")
