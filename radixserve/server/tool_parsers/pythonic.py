"""Pythonic tool calls (SGLang and vLLM `pythonic`; Llama 3.2 / 4 templates):

    [get_weather(city="Paris", days=3), add(a=1, b=2)]

at the start of the output (or after `<|python_start|>`). Each argument is read with `ast`
as a literal (never evaluated); JSON's true / false / null are accepted as well as Python's.
Forced: `[name(p=VALUE, ...)]` with the tool's required parameters, in `required` order."""

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
    identifier,
    literal,
)

START, END = "<|python_start|>", "<|python_end|>"
JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False,
              "None": None}  # fmt: skip
_NO_VALUE = object()


def read(src: Source, sink: CallSink, marker: str) -> Reader:
    if not (yield from literal(src, "[")):
        return False
    while True:
        name = yield from identifier(src)
        if name is None or not (yield from literal(src, "(")) or not sink.begin(name):
            return False
        if not (yield from _read_arguments(src, sink)):
            return False
        if not (yield from literal(src, ",")):
            break
    if not (yield from literal(src, "]")):
        return False
    if marker:
        yield from literal(src, END)
    return True


def _read_arguments(src: Source, sink: CallSink) -> Reader:
    """`key=value, ...)`, streamed as one JSON object, a member per argument."""
    sink.arguments("{")
    first = True
    while not (yield from literal(src, ")")):
        if not first and not (yield from literal(src, ",")):
            break
        key = yield from identifier(src)
        if key is None or not (yield from literal(src, "=")):
            break
        value = yield from _literal_value(src)
        if value is _NO_VALUE:
            break
        member = f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}"
        sink.arguments(member if first else ", " + member)
        first = False
    else:
        sink.arguments("}")
        return True
    sink.arguments("}")
    return False


def _literal_value(src: Source):
    """The Python literal next, up to a `,` or `)` outside brackets and strings."""
    while True:
        end = _value_end(src.rest)
        if end is not None:
            value = _to_json(src.rest[:end])
            if value is not _NO_VALUE:
                src.pos += end
            return value
        if src.final:
            return _NO_VALUE
        yield


def _value_end(text: str) -> int | None:
    depth, quote, i = 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return i if ch == ")" else None
            depth -= 1
        elif ch == "," and depth == 0:
            return i
        i += 1
    return None


def _to_json(source: str) -> Any:
    try:
        node = ast.parse(source.strip(), mode="eval").body
        return _node_value(node)
    except (SyntaxError, ValueError, RecursionError):
        return _NO_VALUE


def _node_value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool)):
        return node.value
    if isinstance(node, ast.Constant) and node.value is None:
        return None
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _node_value(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_node_value(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {str(k.value): _node_value(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


def forced(tools: list[dict[str, Any]], name: str | None) -> tuple[str, Any]:
    def call(function: dict) -> Any:
        schema = function["parameters"]
        properties = schema.get("properties", {})
        parts = [grammar.text(f"[{function['name']}(")]
        for i, key in enumerate(k for k in schema.get("required", []) if k in properties):
            parts.append(grammar.text(f"{', ' if i else ''}{key}="))
            parts.append(grammar.json_value(properties[key]))
        parts.append(grammar.text(")]"))
        return grammar.concat(*parts)

    return "ebnf", grammar.forced_ebnf(tools, name, call)


def write_call(name: str, arguments: dict[str, Any]) -> str:
    values = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())
    return f"[{name}({values})]"


INSTRUCTION = """To call functions, answer with only a Python list of calls with keyword arguments:
[<function-name>(<parameter>=<value>, ...), ...]"""

PYTHONIC = ToolFormat("pythonic", (START,), read, forced, write_call, INSTRUCTION, bare_start="[")
