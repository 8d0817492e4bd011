"""DeepSeek-V3 tool calls (SGLang `deepseekv3`, vLLM `deepseek_v3`):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Forced: that block with one call."""

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
    literal,
    until,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


def read(src: Source, sink: CallSink, marker: str) -> Reader:
    while (yield from literal(src, CALL_BEGIN)):
        if not (yield from literal(src, "function")) or not (yield from literal(src, SEP)):
            return False
        name = yield from until(src, "\n")
        if name is None or not (yield from literal(src, FENCE_OPEN)):
            return False
        if not (yield from begin_json_call(src, sink, name.strip())):
            return False
        if not (yield from literal(src, FENCE_CLOSE)) or not (yield from literal(src, CALL_END)):
            return False
    return (yield from literal(src, CALLS_END))


def forced(tools: list[dict[str, Any]], name: str | None) -> tuple[str, Any]:
    def call(function: dict) -> Any:
        head = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{function['name']}\n{FENCE_OPEN}\n"
        return grammar.concat(
            grammar.text(head),
            grammar.json_value(function["parameters"]),
            grammar.text(f"\n{FENCE_CLOSE}{CALL_END}{CALLS_END}"),
        )

    return "ebnf", grammar.forced_ebnf(tools, name, call)


def write_call(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps(arguments, ensure_ascii=False)
    call = f"{CALL_BEGIN}function{SEP}{name}\n{FENCE_OPEN}\n{body}\n{FENCE_CLOSE}{CALL_END}"
    return f"{CALLS_BEGIN}{call}{CALLS_END}"


EXAMPLE = write_call("<function-name>", {}).replace("{}", "<arguments-json-object>")
INSTRUCTION = f"To call a function, answer with a block like this one (a {CALL_BEGIN} per call):\n"
INSTRUCTION += EXAMPLE

DEEPSEEKV3 = ToolFormat("deepseekv3", (CALLS_BEGIN,), read, forced, write_call, INSTRUCTION)
