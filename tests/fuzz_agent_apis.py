"""Fuzz bodies and answer checks for the agent APIs (tests/test_http_fuzz.py): Anthropic's
Messages API (/v1/messages, /v1/messages/count_tokens) and OpenAI's Responses API
(/v1/responses).

Every answer must be a 2xx (a stream ending in message_stop / response.completed or
response.incomplete, with no error event) or a 4xx in the API's own error shape naming the
offending field: Anthropic's message starts with it (quoted, or as a path), OpenAI's
`param` is it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fuzz_common import (
    ARGUMENTS,
    DEEP,
    JSON_TEXTS,
    ODD_TEMPLATE_KWARGS,
    TEMPLATE_KWARGS,
    fuzzed,
    names_a_field,
    odd,
    openai_error_problems,
    top_fields,
)
from hypothesis import strategies as st

PREVIOUS = "<previous>"
"""A previous_response_id the test replaces with a stored response's id."""
ODD_TOKENS = odd(0, -1, 10**6, 2**63, 10**30, 2.5, "3", True)
ODD_CONSTRAINTS = {
    "regex": odd("[a-", "a{99999999}", "[ab]{1,3}"),
    "json_schema": odd("{not json", {"type": "nonsense"}, {"type": "object"}, "<deep object>"),
    "ebnf": odd("root ::= undefined", 'root ::= "a"'),
}

# ---- Anthropic's Messages API ------------------------------------------------------------

A_TOOL = {"name": "f", "description": "adds", "input_schema": {"type": "object"}}
A_TOOL_USE = {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}
A_RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "4"}
A_THINKING = {"type": "thinking", "thinking": "hm", "signature": ""}
MARK = {"type": "ephemeral"}
MARKED_TEXT = {"type": "text", "text": "hi", "cache_control": MARK}
A_MESSAGE = st.sampled_from(
    [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [MARKED_TEXT]},
        {"role": "assistant", "content": "The answer is"},
        {"role": "assistant", "content": [A_THINKING, {"type": "text", "text": "ok"}, A_TOOL_USE]},
        {"role": "user", "content": [A_RESULT, {"type": "text", "text": "go on"}]},
        {"role": "user", "content": [A_RESULT | {"is_error": True, "content": [MARKED_TEXT]}]},
    ]
)
A_CONVERSATION = st.lists(A_MESSAGE, min_size=1, max_size=3) | st.just(
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": [A_TOOL_USE]},
        {"role": "user", "content": [A_RESULT]},
    ]
)
A_ODD_INPUT = st.builds(lambda deep: A_TOOL_USE | {"input": {"a": deep}}, DEEP)
A_ODD_MESSAGES = odd(
    [],
    "hi",
    [{"role": "system", "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image"}]}],
    [{"role": "user", "content": [{"type": "nope"}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]}],
    [{"role": "user", "content": [{"type": "text", "text": "x", "citations": []}]}],
    [{"role": "user", "content": "x", "name": "n"}],
    [{"role": "assistant", "content": [A_TOOL_USE | {"input": "{}"}]}],
    [{"role": "user", "content": [A_RESULT | {"content": 5}]}],
    [{"role": "user", "content": [A_RESULT | {"is_error": "yes"}]}],
    [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"ttl": 5}}]}],
) | st.builds(lambda use: [{"role": "assistant", "content": [use]}], A_ODD_INPUT)
MESSAGES_OPTIONAL = {
    "system": st.sampled_from(["Be brief.", [{"type": "text", "text": "Be brief."}]]),
    "tools": st.just([A_TOOL]),
    "tool_choice": st.sampled_from(
        [{"type": t} for t in ("auto", "any", "none")]
        + [{"type": "tool", "name": "f", "disable_parallel_tool_use": True}]
    ),
    "thinking": st.sampled_from([{"type": "disabled"}])
    | st.builds(lambda n: {"type": "enabled", "budget_tokens": n}, st.integers(1, 3)),
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([1, 5, 50]),
    "stop_sequences": st.sampled_from([["\n"], ["the", "a"], []]),
    "metadata": st.just({"user_id": "u1"}),
    "cache_control": st.just(MARK),
    "chat_template_kwargs": TEMPLATE_KWARGS,
    "seed": st.integers(-5, 2**40),
    "ignore_eos": st.booleans(),
    "service_tier": st.just("auto"),
}
ODD_MESSAGES_FIELDS = {
    "model": odd("other", 5),
    "max_tokens": ODD_TOKENS,
    "messages": A_ODD_MESSAGES,
    "system": odd(5, [{"type": "text"}], [{"type": "image"}], [{"type": "text", "text": 1}]),
    "tools": odd(
        [{"type": "bash_20250124", "name": "bash"}],
        [A_TOOL, A_TOOL],
        [{"name": "f"}],
        [{"name": "bad name", "input_schema": {}}],
        [A_TOOL | {"input_schema": {"type": "bogus"}}],
        [A_TOOL | {"input_schema": "<deep object>"}],
        {},
    ),
    "tool_choice": odd(
        "auto",
        {"type": "any"},
        {"type": "tool"},
        {"type": "tool", "name": "g"},
        {"type": "auto", "disable_parallel_tool_use": "yes"},
        {"type": "none", "name": "f"},
    ),
    "thinking": odd(
        {"type": "enabled"},
        {"type": "enabled", "budget_tokens": 0},
        {"type": "enabled", "budget_tokens": 10**30},
        {"type": "enabled", "budget_tokens": 2},
        {"type": "disabled", "budget_tokens": 2},
        {"type": "adaptive"},
    ),
    "stream": odd(1, "true"),
    "temperature": odd(1.5, -1, "x", math.nan),
    "top_p": odd(0, 2),
    "top_k": odd(0, -2, 10**30),
    "stop_sequences": odd("END", [""], [1]),
    "metadata": odd({"user_id": 5}, {"x": 1}),
    "cache_control": odd({"type": "x"}, {"type": "ephemeral", "ttl": "2h"}),
    "chat_template_kwargs": ODD_TEMPLATE_KWARGS,
    "seed": odd(2**63, 10**30, "7"),
    "ignore_eos": odd(1),
    "service_tier": odd("priority"),
    **ODD_CONSTRAINTS,
}
MESSAGES_BODY = fuzzed(
    st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "max_tokens": st.integers(1, 4),
            "messages": A_CONVERSATION,
            "stream": st.booleans(),
        },
        optional=MESSAGES_OPTIONAL,
    ),
    ODD_MESSAGES_FIELDS,
)
MESSAGES_PATH = st.sampled_from(["/v1/messages"] * 3 + ["/v1/messages/count_tokens"])
COUNT_ONLY_DROPS = {
    *"max_tokens stream temperature top_p top_k stop_sequences metadata seed".split(),
    *"ignore_eos service_tier regex json_schema ebnf".split(),
}
"""The fields of a Messages body that /v1/messages/count_tokens does not take."""


def for_path(path: str, body: Any) -> Any:
    """`body` as sent to `path`: to count_tokens without the fields only /v1/messages takes."""
    if path.endswith("/count_tokens") and isinstance(body, dict):
        return {k: v for k, v in body.items() if k not in COUNT_ONLY_DROPS}
    return body


# ---- OpenAI's Responses API --------------------------------------------------------------

R_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
R_CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}
R_OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "4"}
R_ITEM = st.sampled_from(
    [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "reasoning", "summary": []},
        R_OUTPUT,
        R_OUTPUT | {"output": [{"type": "input_text", "text": "4"}]},
    ]
) | st.builds(lambda arguments: R_CALL | {"arguments": arguments}, ARGUMENTS)
R_INPUT = st.sampled_from(["hi", "What is 2+2?"]) | st.lists(R_ITEM, min_size=1, max_size=3)
R_ODD_CALL = st.builds(lambda text: [R_CALL | {"arguments": text}, R_OUTPUT], JSON_TEXTS)
R_ODD_INPUT = (
    odd(
        "",
        [],
        [5],
        [{"role": "bot", "content": "x"}],
        [{"type": "input_image"}],
        [{"type": "item_reference", "id": "x"}],
        [{"role": "user", "content": [{"type": "input_image"}]}],
        [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}],
        [{"role": "user", "content": "x", "bogus": 1}],
        [R_CALL | {"arguments": 5}],
        [R_OUTPUT | {"output": 5}],
        [{"type": "reasoning", "summary": 5}],
    )
    | R_ODD_CALL
)
TEXT_FORMATS = [
    {"format": {"type": "text"}},
    {"format": {"type": "json_object"}},
    {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string"}}},
]
RESPONSES_OPTIONAL = {
    "instructions": st.sampled_from(["Be brief.", ""]),
    "tools": st.just([R_TOOL]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]),
    "parallel_tool_calls": st.booleans(),
    "text": st.sampled_from(TEXT_FORMATS),
    "store": st.booleans(),
    "previous_response_id": st.just(PREVIOUS),
    "metadata": st.just({"k": "v"}),
    "reasoning": st.sampled_from([{"effort": "low"}, {"effort": "none"}, {"summary": "auto"}]),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "user": st.just("u1"),
    "chat_template_kwargs": TEMPLATE_KWARGS,
    "separate_reasoning": st.booleans(),
    "stream_reasoning": st.booleans(),
    "max_reasoning_tokens": st.integers(0, 3),
    "seed": st.integers(-5, 2**40),
    "include": st.just([]),
    "truncation": st.just("disabled"),
}
ODD_RESPONSES_FIELDS = {
    "model": odd("other", 5),
    "input": R_ODD_INPUT,
    "instructions": odd(5, ["x"]),
    "max_output_tokens": ODD_TOKENS,
    "tools": odd(
        [{"type": "web_search"}],
        [R_TOOL, R_TOOL],
        [{"type": "function"}],
        [R_TOOL | {"function": {}}],
        [R_TOOL | {"parameters": "<deep object>"}],
        {},
    ),
    "tool_choice": odd("sometimes", {"type": "function"}, {"type": "function", "name": "g"}),
    "parallel_tool_calls": odd(1),
    "text": odd(
        {"format": {"type": "json_schema"}},
        {"format": {"type": "xml"}},
        {"verbosity": "high"},
        {"format": {"type": "json_schema", "name": "x", "schema": "<deep object>"}},
    ),
    "store": odd(1),
    "previous_response_id": odd("resp_missing", 5, ""),
    "metadata": odd({"k": 5}, {"k" * 65: "v"}),
    "stream": odd(1, "true"),
    "reasoning": odd({"effort": "extreme"}, {"x": 1}, "high"),
    "temperature": odd(-1, 3, "x"),
    "top_p": odd(0, 2),
    "chat_template_kwargs": ODD_TEMPLATE_KWARGS,
    "max_reasoning_tokens": odd(-1, 10**30, "3"),
    "seed": odd(2**63, 10**30, "7"),
    "include": odd(["reasoning.encrypted_content"]),
    "truncation": odd("auto"),
    "background": odd(True),
    "top_logprobs": odd(2),
    **ODD_CONSTRAINTS,
}
RESPONSES_BODY = fuzzed(
    st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "input": R_INPUT,
            "max_output_tokens": st.integers(1, 4),
            "stream": st.booleans(),
        },
        optional=RESPONSES_OPTIONAL,
    ),
    ODD_RESPONSES_FIELDS,
)


def with_previous(body: Any, response_id: str) -> Any:
    """`body` with the PREVIOUS placeholder replaced by a stored response's id."""
    if isinstance(body, dict) and body.get("previous_response_id") == PREVIOUS:
        return body | {"previous_response_id": response_id}
    return body


# ---- checking one answer -----------------------------------------------------------------

MESSAGES_DERIVED = {"body", "messages", "model", "max_tokens", "prompt"}
"""Names an Anthropic 4xx may give besides the body's own fields: the body, required fields
that are missing, the prompt as rendered."""
RESPONSES_DERIVED = {"body", "input", "model", "prompt", "max_output_tokens"}
"""As MESSAGES_DERIVED; max_output_tokens: its default, the room left in the context."""
FIELD_PATH = re.compile(r"^['\"]?([A-Za-z_][\w.\[\]]*)")


def anthropic_problems(body: Any, status: int, text: str) -> list[str]:
    """What is wrong with an answer of /v1/messages or /v1/messages/count_tokens."""
    if status >= 500:
        return [f"{status}: {text[:300]}"]
    if status >= 400:
        return _anthropic_error_problems(top_fields(body) | MESSAGES_DERIVED, status, text)
    if text.startswith("event:"):
        events = sse_events(text)
        problems = [f"error event: {data}" for name, data in events if name == "error"]
        if not events or events[-1][0] != "message_stop":
            problems.append(f"stream does not end with message_stop: ...{text[-200:]}")
        return problems
    reply = json.loads(text)
    return [] if "input_tokens" in reply or reply.get("type") == "message" else [text[:300]]


def _anthropic_error_problems(fields: set[str], status: int, text: str) -> list[str]:
    try:
        reply = json.loads(text)
        kind, message = reply["error"]["type"], reply["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return [f"{status} without an Anthropic error body: {text[:300]}"]
    if reply.get("type") != "error" or not isinstance(kind, str) or not isinstance(message, str):
        return [f"{status} with a malformed error: {reply}"]
    if not starts_with_a_field(message, fields):
        return [f"{status} names no field of the body first in its message: {message[:300]}"]
    return []


def starts_with_a_field(message: str, fields: set[str]) -> bool:
    """Whether `message` starts with one of `fields`, quoted as Python quotes it ('max_tokenz')
    or as a path, quoted or not (messages[0].role, 'messages[0].foo')."""
    if any(message.startswith(repr(field)) for field in fields):
        return True
    path = FIELD_PATH.match(message)
    return path is not None and names_a_field(fields, path.group(1))


def responses_problems(body: Any, status: int, text: str) -> list[str]:
    """What is wrong with an answer of /v1/responses."""
    if status >= 500:
        return [f"{status}: {text[:300]}"]
    if status >= 400:
        return openai_error_problems(top_fields(body) | RESPONSES_DERIVED, status, text)
    if text.startswith("event:"):
        events = sse_events(text)
        last = events[-1][0] if events else None
        if last not in ("response.completed", "response.incomplete"):
            return [f"stream ends with {last}: ...{text[-300:]}"]
        return []
    status_field = json.loads(text).get("status")
    return [] if status_field in ("completed", "incomplete") else [text[:300]]


def sse_events(text: str) -> list[tuple[str, Any]]:
    """(event name, data) of each server-sent event of `text`."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        events.append((lines.get("event", ""), json.loads(lines.get("data", "null"))))
    return events
