"""Tool calling for /v1/chat/completions: checking `tools` and `tool_choice`, and the entry
points to the per-family formats of tool_parsers/ (finding calls in the output, forcing one).
Showing the tools to the model: see chat_prompt.py.

Output. `required` (or a named function) constrains the output to one call in the format of
`--tool-call-parser` (qwen25: one bare JSON call, `{"name": ..., "arguments": {...}}`);
`auto` generates freely. Either way `ToolCallParser` reads the text: each call in the
family's format (a known tool's name, object arguments) is a call; everything else is
content; the whitespace between content and a call is dropped. A malformed block stays
content (streamed: unless it breaks after its call was sent; see tool_parsers/parser.py).

Streaming. Content streams as it settles; text that may begin a call is held. A call is sent
as OpenAI's deltas: the first carries its index, id, type and name, later ones append to
`function.arguments`; concatenated they are the complete JSON arguments (tool_parsers/).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from radixserve.server.errors import BadRequest
from radixserve.server.tool_parsers import (
    DEFAULT_TOOL_PARSER,
    ParsedText,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
)
from radixserve.server.tool_parsers.qwen25 import END as CALL_END
from radixserve.server.tool_parsers.qwen25 import START as CALL_START
from radixserve.server.tool_parsers.qwen25 import call_schema

__all__ = [
    "CALL_END",
    "CALL_START",
    "ParsedText",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "call_schema",
]
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for function names."""
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""The parameters of a function declared without any (OpenAI: an empty parameter list)."""
CHOICE_MODES = ("none", "auto", "required")
FUNCTION_FIELDS = {"name": str, "description": str, "parameters": dict, "strict": bool}
TOOL_SHAPE = "{'type': 'function', 'function': {'name': str, 'description': str, 'parameters': {}}}"


# ---- request fields ----------------------------------------------------------------------


@dataclass(frozen=True)
class ToolChoice:
    """`tool_choice`, normalized: mode "none", "auto", "required" or "function" (+ name)."""

    mode: str
    name: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the output must be a call (and is constrained to one)."""
        return self.mode in ("required", "function")


def check_tools(value: Any) -> list[dict[str, Any]]:
    """`tools` as a list of {"type": "function", "function": {name, description?, parameters}}."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad_tools(f"tools must be a list of function tools; got {str(value)[:80]}")
    tools = [_check_tool(tool, f"tools[{i}]") for i, tool in enumerate(value)]
    names = tool_names(tools)
    if len(set(names)) < len(names):
        raise _bad_tools(f"tools must have distinct function names; got {names}")
    return tools


def _check_tool(tool: Any, where: str) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type") != "function" or len(tool) != 2:
        raise _bad_tools(f"{where} must be {TOOL_SHAPE}; got {str(tool)[:80]}")
    for key, value in function.items():
        kind = FUNCTION_FIELDS.get(key)
        if kind is None and value is not None:
            raise _bad_tools(f"{f'{where}.function.{key}'!r} is not a known field of a function")
        if kind is not None and value is not None and not isinstance(value, kind):
            raise _bad_tools(f"{where}.function.{key} must be a {kind.__name__}; got {value!r}")
    if not NAME_PATTERN.match(function.get("name") or ""):
        raise _bad_tools(f"{where}.function.name must match {NAME_PATTERN.pattern}")
    checked = {k: function[k] for k in ("name", "description") if function.get(k) is not None}
    checked["parameters"] = function.get("parameters") or NO_PARAMETERS
    return {"type": "function", "function": checked}


def _bad_tools(message: str) -> BadRequest:
    return BadRequest(message, param="tools")


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def check_tool_choice(value: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """`tool_choice`: "auto" by default with tools, "none" without; a named tool must exist."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    return checked_tool_choice(_parse_tool_choice(value), value, tools)


def checked_tool_choice(choice: ToolChoice, value: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """`choice` (parsed from `value`) against the tools: a forced one needs tools, a named
    one must be among them; "none" when no tools are offered."""
    if choice.forced and not tools:
        raise BadRequest(f"tool_choice {value!r} requires tools", param="tool_choice")
    if choice.name is not None and choice.name not in tool_names(tools):
        raise BadRequest(
            f"tool_choice names function {choice.name!r}, which is not among the tools "
            f"{tool_names(tools)}",
            param="tool_choice",
        )
    return choice if tools else ToolChoice("none")


def _parse_tool_choice(value: Any) -> ToolChoice:
    if value in CHOICE_MODES:
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return ToolChoice("function", function["name"])
    raise BadRequest(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
        f"{{'name': str}}}}; got {str(value)[:80]}",
        param="tool_choice",
    )


def check_message_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, each call's arguments decoded to an object."""
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{where} must be a non-empty list of tool calls", param=where)
    return [_check_message_call(call, f"{where}[{i}]") for i, call in enumerate(value)]


def _check_message_call(call: Any, where: str) -> dict[str, Any]:
    checked = _message_call(call)
    if checked is None:
        raise BadRequest(
            f"{where} must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
            f"'arguments': a JSON object string}}}}; got {str(call)[:80]}",
            param=where,
        )
    return checked


def _message_call(call: Any) -> dict[str, Any] | None:
    """A history call with its arguments decoded; None if it is not one."""
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        return None
    function, call_id = call.get("function"), call.get("id") or ""
    if not isinstance(function, dict) or not isinstance(call_id, str):
        return None
    name, arguments = function.get("name"), function.get("arguments")
    if isinstance(arguments, str):
        arguments = json_object(arguments)
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def json_object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object, or None: also for JSON Python's parser refuses (nested too
    deeply: RecursionError; an int past 4300 digits: ValueError). Raw control characters in
    strings are allowed: the grammar lets them into length-bounded strings; re-encoding
    escapes them."""
    try:
        value = json.loads(text, strict=False)
    except (ValueError, RecursionError):  # ValueError: JSONDecodeError too
        return None
    return value if isinstance(value, dict) else None


# ---- output ----------------------------------------------------------------------------


def parse_tool_calls(
    text: str,
    names: list[str],
    tool_parser: str = DEFAULT_TOOL_PARSER,
    schemas: dict[str, Any] | None = None,
) -> ParsedText:
    """A whole output's content and tool calls, in the format `tool_parser` names (each
    region judged whole: a call that breaks is content)."""
    return ToolCallParser(names, tool_parser, schemas, streaming=False).feed(text, final=True)


def tool_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's parameters schema by name (what a parser types untyped values with)."""
    return {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
