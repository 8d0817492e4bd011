"""A chat request's input, checked: the messages (roles, text content, tool calls and
results, an assistant turn's past reasoning) and the chat template's extra variables.
Shared by /v1/chat/completions and /tokenize; chat_prompt.py renders what passes."""

from __future__ import annotations

from typing import Any

from radixserve.server.errors import BadRequest
from radixserve.server.tool_calls import check_message_tool_calls

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name")
REASONING_KEYS = ("reasoning_content", "reasoning")
"""An assistant turn's reasoning, as SGLang and vLLM return it (vLLM's newer name: reasoning)
and agents send it back."""
ROLE_KEYS = {"assistant": ("tool_calls", *REASONING_KEYS), "tool": ("tool_call_id",)}
MAX_TEMPLATE_KWARGS_DEPTH = 32
"""How deeply chat_template_kwargs may nest: far past any template's switches, well short of
Python's recursion limit, which rendering (transformers walks the template's data) hits."""


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: role, string content, optional name; an
    assistant's tool_calls (content optional) and a tool result's tool_call_id."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of message objects", "messages")
    return [_check_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _check_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object; got {message!r}", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {ROLES}; got {role!r}", f"{where}.role")
    for key, value in message.items():
        if key not in MESSAGE_KEYS + ROLE_KEYS.get(role, ()) and value is not None:
            raise BadRequest(f"{where}.{key} is not supported by this server", f"{where}.{key}")
    checked = {"role": role} | _tool_fields(message, where)
    content = message.get("content")
    has_calls = "tool_calls" in checked
    checked["content"] = "" if content is None and has_calls else _content_text(content, where)
    if message.get("name") is not None:
        checked["name"] = _check_str(message["name"], f"{where}.name")
    reasoning = _reasoning(message, where)
    return checked | (with_reasoning(reasoning) if reasoning else {})


def _reasoning(message: dict[str, Any], where: str) -> str | None:
    """An assistant turn's reasoning text, under either name (the two must agree)."""
    given = {k: message[k] for k in REASONING_KEYS if message.get(k) is not None}
    for key, value in given.items():
        _check_str(value, f"{where}.{key}")
    if len(set(given.values())) > 1:
        raise BadRequest(f"{where}.reasoning and {where}.reasoning_content disagree",
                         param=f"{where}.reasoning")  # fmt: skip
    return next(iter(given.values()), None)


def with_reasoning(text: str) -> dict[str, str]:
    """The keys that carry an assistant turn's past reasoning into the chat template: HF
    templates that keep it (Qwen3, DeepSeek-V3.1, GLM-4.5: after the last user turn) read
    `reasoning_content`, gpt-oss's reads `thinking`; the others ignore both."""
    return {"reasoning_content": text, "thinking": text}


def _tool_fields(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's tool_calls (arguments decoded) or a tool result's tool_call_id."""
    if message["role"] == "tool":
        return {"tool_call_id": _check_str(message.get("tool_call_id"), f"{where}.tool_call_id")}
    if message.get("tool_calls") in (None, []):  # some clients send [] for no calls
        return {}
    return {"tool_calls": check_message_tool_calls(message["tool_calls"], f"{where}.tool_calls")}


def _check_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a string; got {value!r}", param=where)
    return value


def _content_text(content: Any, where: str) -> str:
    """String content as is; text parts joined by newlines (vLLM's "string" format)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        return "\n".join(part["text"] for part in content)
    raise BadRequest(
        f"{where}.content must be a string or a list of {{'type': 'text', 'text': str}} parts; "
        f"got {str(content)[:80]}",
        param=f"{where}.content",
    )


def _is_text_part(part: Any) -> bool:
    return (
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
    )


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """Extra template variables; never a template of the request's own (as in vLLM, a
    request's Jinja template could render for ever or exhaust memory)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    if _nests_deeper(kwargs, MAX_TEMPLATE_KWARGS_DEPTH):
        raise BadRequest(
            f"chat_template_kwargs nests deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels",
            param="chat_template_kwargs",
        )
    if kwargs.get("chat_template") is not None:
        raise BadRequest(
            "chat_template_kwargs.chat_template is not allowed: the model's chat template is used",
            param="chat_template_kwargs.chat_template",
        )
    return kwargs


def _nests_deeper(value: Any, depth: int) -> bool:
    """Whether `value` holds lists or objects nested more than `depth` levels deep."""
    if not isinstance(value, (dict, list)):
        return False
    if depth == 0:
        return True
    children = value.values() if isinstance(value, dict) else value
    return any(_nests_deeper(child, depth - 1) for child in children)
