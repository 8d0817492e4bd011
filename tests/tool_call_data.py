"""What the tool-call tests (tests/test_tool_calls_*.py and the agent APIs' tests) share: the
served model's name, two tools with bounded schemas (the random model's arguments end in
time), a call as the model writes it, a history with a call and its result, and a chat
template that renders tools."""

from __future__ import annotations

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -50, "maximum": 50},
        "b": {"type": "integer", "minimum": -50, "maximum": 50},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
NAMES = list(SCHEMAS)
CALL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
HISTORY = [
    {"role": "user", "content": "What is 1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]  # fmt: skip


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}"
    "{{ c.function.arguments | tojson }}{% endfor %}|{% endfor %}"
)
"""Renders the tools and each turn's calls as they are, as Qwen's or Llama 3.1's templates do."""
