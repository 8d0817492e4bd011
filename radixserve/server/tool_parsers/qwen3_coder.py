"""Qwen3-Coder tool calls (SGLang and vLLM `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are raw text, typed by the tool's schema: strings as written, numbers, booleans,
null, objects and arrays parsed (JSON, else a Python literal), anything unparsable a string.
Forced: that block with the tool's required parameters."""

from __future__ import annotations

import ast
import json
from typing import Any

from radixserve.server.tool_parsers import grammar
from radixserve.server.tool_parsers.base import (
    CallSink,
    Reader,
    Source,
    ToolFormat,
    literal,
    until,
)

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def read(src: Source, sink: CallSink, marker: str) -> Reader:
    if marker == START and not (yield from literal(src, FUNCTION)):
        return False
    name = yield from until(src, ">")
    if name is None or not sink.begin(name.strip()):
        return False
    properties = sink.schema(name.strip()).get("properties", {})
    sink.arguments("{")
    first = True
    while (yield from literal(src, PARAMETER)):
        key = yield from until(src, ">")
        value = None if key is None else (yield from until(src, PARAMETER_END))
        if value is None:
            sink.arguments("}")
            return False
        typed = typed_value(_trim(value), properties.get(key.strip()) or {})
        member = f"{json.dumps(key.strip())}: {json.dumps(typed, ensure_ascii=False)}"
        sink.arguments(member if first else ", " + member)
        first = False
    sink.arguments("}")
    if not (yield from literal(src, FUNCTION_END)):
        return False
    if marker == START:
        yield from literal(src, END)
    return True


def _trim(value: str) -> str:
    """The value without the one newline the format puts on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def typed_value(text: str, schema: dict[str, Any]) -> Any:
    """`text` as the schema's type says; a string when it does not parse as that type."""
    kinds = schema.get("type", "string")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds or not kinds:
        return text
    stripped = text.strip()
    if stripped == "null" and "null" in kinds:
        return None
    for kind in kinds:
        value = _parse(stripped, kind)
        if value is not None:
            return value
    return text


def _parse(text: str, kind: str) -> Any:
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind in ("integer", "number", "object", "array"):
        for parse in (json.loads, ast.literal_eval):
            try:
                value = parse(text)
            except (ValueError, SyntaxError, RecursionError):
                continue
            if _is_kind(value, kind):
                return value
    return None


def _is_kind(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    types = {"integer": int, "number": (int, float), "object": dict, "array": (list, tuple)}
    return isinstance(value, types[kind])


def forced(tools: list[dict[str, Any]], name: str | None) -> tuple[str, Any]:
    def call(function: dict) -> Any:
        schema = function["parameters"]
        properties = schema.get("properties", {})
        parts = [grammar.text(f"{START}\n{FUNCTION}{function['name']}>\n")]
        for key in (k for k in schema.get("required", []) if k in properties):
            parts += [grammar.text(f"{PARAMETER}{key}>\n"), _value_grammar(properties[key])]
            parts.append(grammar.text(f"\n{PARAMETER_END}\n"))
        parts.append(grammar.text(f"{FUNCTION_END}\n{END}"))
        return grammar.concat(*parts)

    return "ebnf", grammar.forced_ebnf(tools, name, call)


def _value_grammar(schema: dict[str, Any]) -> Any:
    """Raw text for a string parameter (no `<`, at most its maxLength; an enum's values),
    JSON otherwise."""
    values = schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return grammar.rule(" | ".join(json.dumps(v, ensure_ascii=False) for v in values))
    if schema.get("type") == "string":
        return grammar.rule(f"[^<\\n]{{0,{int(schema.get('maxLength', 256))}}}")
    return grammar.json_value(schema)


def write_call(name: str, arguments: dict[str, Any]) -> str:
    parameters = "".join(
        f"{PARAMETER}{k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
        f"\n{PARAMETER_END}\n"
        for k, v in arguments.items()
    )
    return f"{START}\n{FUNCTION}{name}>\n{parameters}{FUNCTION_END}\n{END}"


EXAMPLE = write_call("<function-name>", {"<parameter>": "<value>"})
INSTRUCTION = "To call a function, answer with a block like this one per call:\n" + EXAMPLE

QWEN3_CODER = ToolFormat("qwen3_coder", (START, FUNCTION), read, forced, write_call, INSTRUCTION)
