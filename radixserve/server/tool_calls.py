"""Tool calling for /v1/chat/completions: checking `tools` and `tool_choice`, forcing a call
with a JSON schema, and finding calls in the output. Showing the tools to the model: see
chat_prompt.py.

Output. `required` (or a named function) constrains the output to one bare JSON call,
`{"name": ..., "arguments": {...}}`; `auto` generates freely. Either way `ToolCallParser`
reads the text: each valid `<tool_call>` block (a known tool's name, object arguments) is a
call, and so is an output that is, as a whole, one such JSON object. Everything else is
content; the whitespace between content and a call is dropped. A malformed block stays content.

Streaming. Content streams as it settles. From a `<tool_call>` tag to its end tag the text is
held; a valid block is sent as one delta carrying the whole call (id, name and the complete
arguments string), not as argument fragments. An output whose first non-blank character is
"{" may be a bare call, so it is held to the end (this covers `required`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.errors import BadRequest

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
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
            raise _bad_tools(f"{where}.function.{key} is not a known field")
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
    choice = _parse_tool_choice(value)
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


def call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """A JSON schema for one call, {"name": NAME, "arguments": PARAMETERS}, of any of the
    tools (anyOf) or of just the one named."""
    cases = [_call_case(t["function"]) for t in tools if name in (None, t["function"]["name"])]
    return cases[0] if len(cases) == 1 else {"anyOf": cases}


def _call_case(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": function["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


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
        arguments = _json_object(arguments)
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _json_object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object, or None. Raw control characters in strings are allowed: the
    grammar lets them into length-bounded strings; re-encoding escapes them."""
    try:
        value = json.loads(text, strict=False)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


# ---- output ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One call found in a choice's output; `arguments` is a JSON object string."""

    index: int
    id: str
    name: str
    arguments: str

    def to_openai(self, streamed: bool = False) -> dict[str, Any]:
        """OpenAI's tool call; stream deltas also carry the call's index in the choice."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return {"index": self.index} | call if streamed else call


@dataclass
class ParsedText:
    """What settled of a choice's output: content text and complete tool calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Splits one choice's output into content and tool calls as the text arrives.

    `feed` returns what has settled; text that may still turn into a call is held. The
    parse is the same however the text is cut into pieces.
    """

    def __init__(self, names: list[str]):
        self.names = set(names)
        self.buffer = ""  # text not yet returned
        self.in_block = False  # buffer starts inside a <tool_call> block (its tag consumed)
        self.block_gap = ""  # whitespace before the open block: dropped if it is a call
        self.bare: bool | None = None  # output may be one bare JSON call; None: undecided
        self.after_call = False  # leading whitespace of the next content is dropped
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> ParsedText:
        """Parses `text`, the output's next piece; `final` when it is the last one."""
        self.buffer += text
        if self.bare is None and self.buffer.strip():
            self.bare = self.buffer.lstrip().startswith("{")
        out = ParsedText()
        if self.bare and not final:
            return out  # a bare call is judged whole, at the end
        if self.bare and (call := self._call(self.buffer)) is not None:
            self.buffer = ""
            out.calls.append(call)
            return out
        while self._step(out, final):
            pass
        return out

    def _step(self, out: ParsedText, final: bool) -> bool:
        """Moves one piece of the buffer into `out`; False when the rest must wait."""
        if self.in_block:
            return self._close_block(out, final)
        start = self.buffer.find(CALL_START)
        if start >= 0:
            before = self.buffer[:start]
            self._add_content(out, before.rstrip())
            self.block_gap = before[len(before.rstrip()) :]
            self.buffer, self.in_block = self.buffer[start + len(CALL_START) :], True
            return True
        keep = 0 if final else held_tail(self.buffer)
        self._add_content(out, self.buffer[: len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False

    def _close_block(self, out: ParsedText, final: bool) -> bool:
        end = self.buffer.find(CALL_END)
        if end < 0 and not final:
            return False
        body = self.buffer if end < 0 else self.buffer[:end]
        self.buffer = "" if end < 0 else self.buffer[end + len(CALL_END) :]
        self.in_block = False
        call = self._call(body)
        if call is None:
            tail = "" if end < 0 else CALL_END
            self._add_content(out, self.block_gap + CALL_START + body + tail)
        else:
            out.calls.append(call)
            self.after_call = True
        return end >= 0

    def _add_content(self, out: ParsedText, text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        out.content += text

    def _call(self, text: str) -> ToolCall | None:
        """The call `text` holds, if it is {"name": a known tool, "arguments": {...}}."""
        value = _json_object(text.strip())
        if value is None or set(value) - {"name", "arguments"}:
            return None
        name, arguments = value.get("name"), value.get("arguments", {})
        if not isinstance(name, str) or name not in self.names or not isinstance(arguments, dict):
            return None
        index, self.num_calls = self.num_calls, self.num_calls + 1
        arguments_text = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(index, f"call_{uuid.uuid4().hex}", name, arguments_text)


def held_tail(text: str) -> int:
    """How many trailing characters may still precede or begin a <tool_call> tag: a partial
    tag and the whitespace before it."""
    head = text[: len(text) - _partial_tag(text)]
    return len(text) - len(head.rstrip())


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that begins CALL_START (but is not all of it)."""
    for k in range(min(len(text), len(CALL_START) - 1), 0, -1):
        if CALL_START.startswith(text[-k:]):
            return k
    return 0


def parse_tool_calls(text: str, names: list[str]) -> ParsedText:
    """A whole output's content and tool calls."""
    return ToolCallParser(names).feed(text, final=True)
