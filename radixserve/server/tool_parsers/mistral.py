"""Mistral tool calls (SGLang and vLLM `mistral`), both generations:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1}    (v11+)

A list at the very start of the output is read too: tokenizers that make `[TOOL_CALLS]` a
special token drop it from the text unless `skip_special_tokens` is off. Forced: the list
form with one call."""

from __future__ import annotations

import json
from typing import Any

from radixserve.server.tool_parsers import grammar
from radixserve.server.tool_parsers.base import (
    CallSink,
    Reader,
    Source,
    ToolFormat,
    begin_json_call,
    identifier,
    json_envelope,
    literal,
    until,
)

START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def read(src: Source, sink: CallSink, marker: str) -> Reader:
    if (yield from literal(src, "[")):
        return (yield from _read_list(src, sink))
    while True:
        name = yield from identifier(src)
        if name is None:
            return False
        if (yield from literal(src, CALL_ID)) and (yield from until(src, ARGS)) is None:
            return False
        yield from literal(src, ARGS)
        if not (yield from begin_json_call(src, sink, name)):
            return False
        if not (yield from literal(src, START)):
            return True


def _read_list(src: Source, sink: CallSink) -> Reader:
    while (yield from json_envelope(src, sink, ("arguments",))):
        if not (yield from literal(src, ",")):
            return (yield from literal(src, "]"))
    return False


def forced(tools: list[dict[str, Any]], name: str | None) -> tuple[str, Any]:
    def call(function: dict) -> Any:
        envelope = f'{{"name": "{function["name"]}", "arguments": '
        return grammar.concat(
            grammar.text(f"{START}[{envelope}"),
            grammar.json_value(function["parameters"]),
            grammar.text("}]"),
        )

    return "ebnf", grammar.forced_ebnf(tools, name, call)


def write_call(name: str, arguments: dict[str, Any]) -> str:
    return f"{START} {json.dumps([{'name': name, 'arguments': arguments}], ensure_ascii=False)}"


INSTRUCTION = """To call functions, answer with [TOOL_CALLS] and a JSON list of calls:
[TOOL_CALLS] [{"name": <function-name>, "arguments": <arguments-json-object>}]"""

MISTRAL = ToolFormat("mistral", (START,), read, forced, write_call, INSTRUCTION, bare_start="[")
