"""The Responses API's items: `input` (a string or a list of items) checked and normalized
into the items a stored response keeps, and any list of items (a chain's history, then this
turn's input) converted to the chat-completions message list that chat_prompt.py renders.

    "text" / {"role", "content"} / {"type": "message", ...}  -> a message item
        role user | system | developer (-> system) | assistant; content a string or
        parts: input_text, output_text (assistant), each {"type", "text"}
    {"type": "function_call", "call_id", "name", "arguments"}   -> an assistant tool call
    {"type": "function_call_output", "call_id", "output"}       -> a `tool` turn
    {"type": "reasoning", "content": [reasoning_text parts]}     -> the reasoning of the
        assistant turn right after it (`reasoning_content`: the chat template keeps or drops
        it, as Qwen3's keeps it after the last user turn); without content, the parts
        its `encrypted_content` holds (seal_reasoning)

Messages: an assistant message and the function calls right after it are one assistant turn
(content + tool_calls); calls without a message before them get an empty one.
Images, files, audio and item references are a 400 naming the item.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping
from typing import Any

from radixserve.server.chat_messages import with_reasoning
from radixserve.server.errors import BadRequest
from radixserve.server.request_fields import check_fields
from radixserve.server.tool_calls import json_object

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
"""Message roles and the chat role each becomes."""
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
TEXT_PART_KEYS = {
    "input_text": {"type", "text"},
    "output_text": {"type", "text", "annotations", "logprobs"},
}
CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status", "namespace"}
OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
REASONING_KEYS = {"type", "id", "summary", "content", "encrypted_content", "status"}
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio", "refusal")
SEAL_PREFIX = "rsv1:"
"""What starts every `encrypted_content` this server writes (seal_reasoning)."""
ITEM_ID_PREFIXES = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "reasoning": "rs_",
}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def check_input(value: Any) -> list[dict[str, Any]]:
    """`input` as normalized items (each with an id), as `input_items` lists them."""
    if isinstance(value, str):
        return [_message_item("user", [{"type": "input_text", "text": value}])]
    if not isinstance(value, list) or not value:
        raise BadRequest(
            f"input must be a string or a non-empty list of items; got {value!r}"[:160], "input"
        )
    return [check_item(item, f"input[{i}]") for i, item in enumerate(value)]


def check_item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise BadRequest(f"{where} must be an item object; got {item!r}"[:160], param=where)
    kind = item.get("type", "message" if "role" in item else None)
    checks = {
        "message": _check_message,
        "function_call": _check_call,
        "function_call_output": _check_call_output,
        "reasoning": _check_reasoning,
    }
    if not isinstance(kind, str) or kind not in checks:
        raise BadRequest(
            f"{where}.type {kind!r} is not supported by this server; expected one of "
            f"{sorted(checks)}",
            param=f"{where}.type",
        )
    return checks[kind](item, where)


def _check_str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{where}.{key} must be a string; got {value!r}"[:160], f"{where}.{key}")
    return value


def _item_id(item: dict[str, Any], kind: str, where: str) -> str:
    if item.get("id") is None:
        return new_id(ITEM_ID_PREFIXES[kind])
    return _check_str(item, "id", where)


# ---- messages ----------------------------------------------------------------------------


def _message_item(role: str, content: list[dict[str, Any]], item_id: str | None = None):
    return {
        "type": "message",
        "id": item_id or new_id("msg_"),
        "role": role,
        "content": content,
        "status": "completed",
    }


def _check_message(item: dict[str, Any], where: str) -> dict[str, Any]:
    check_fields(item, MESSAGE_KEYS, {}, where, of="a message")
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(
            f"{where}.role must be one of {sorted(ROLES)}; got {role!r}", f"{where}.role"
        )
    content = item.get("content")
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [{"type": part_type, "text": content}]
    elif isinstance(content, list):
        parts = [_check_part(p, role, f"{where}.content[{j}]") for j, p in enumerate(content)]
    else:
        raise BadRequest(
            f"{where}.content must be a string or a list of content parts; got {content!r}"[:160],
            param=f"{where}.content",
        )
    return _message_item(role, parts, _item_id(item, "message", where))


def _check_part(part: Any, role: str, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    allowed = ("input_text", "output_text") if role == "assistant" else ("input_text",)
    if kind not in allowed:
        reason = "is unknown"
        if isinstance(kind, str) and kind in UNSUPPORTED_PARTS:  # (a list is no dict key)
            reason = "is not supported by this server"
        elif isinstance(kind, str) and kind in TEXT_PART_KEYS:
            reason = f"is not allowed in a {role} message"
        message = f"{where}.type {kind!r} {reason}; expected one of {allowed}"
        raise BadRequest(message[:200], param=f"{where}.type")
    check_fields(part, TEXT_PART_KEYS[kind], {}, where, of=f"an {kind} part")
    text = _check_str(part, "text", where)
    if kind == "output_text":
        return {"type": kind, "text": text, "annotations": []}
    return {"type": kind, "text": text}


# ---- calls, their outputs, reasoning -----------------------------------------------------


def _check_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    check_fields(item, CALL_KEYS, {}, where, of="a function_call item")
    checked = {k: _check_str(item, k, where) for k in ("call_id", "name", "arguments")}
    if json_object(checked["arguments"]) is None:
        raise BadRequest(
            f"{where}.arguments must be a JSON object string; got {checked['arguments']!r}"[:160],
            param=f"{where}.arguments",
        )
    item_id = _item_id(item, "function_call", where)
    return {"type": "function_call", "id": item_id, **checked, "status": "completed"}


def _check_call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    check_fields(item, OUTPUT_KEYS, {}, where, of="a function_call_output item")
    call_id = _check_str(item, "call_id", where)
    output = item.get("output")
    if isinstance(output, list):
        parts = [_check_part(p, "tool", f"{where}.output[{j}]") for j, p in enumerate(output)]
        output = "\n".join(part["text"] for part in parts)
    elif not isinstance(output, str):
        raise BadRequest(
            f"{where}.output must be a string or a list of input_text parts; got {output!r}"[:160],
            param=f"{where}.output",
        )
    item_id = _item_id(item, "function_call_output", where)
    return {
        "type": "function_call_output",
        "id": item_id,
        "call_id": call_id,
        "output": output,
        "status": "completed",
    }


def _check_reasoning(item: dict[str, Any], where: str) -> dict[str, Any]:
    check_fields(item, REASONING_KEYS, {}, where, of="a reasoning item")
    summary = item.get("summary", [])
    if not isinstance(summary, list):
        raise BadRequest(f"{where}.summary must be a list", param=f"{where}.summary")
    content = item.get("content") or []
    if not isinstance(content, list) or not all(_is_reasoning_part(p) for p in content):
        raise BadRequest(
            f"{where}.content must be a list of {{'type': 'reasoning_text', 'text': str}} parts; "
            f"got {str(content)[:80]}",
            param=f"{where}.content",
        )
    sealed = item.get("encrypted_content")
    if not content and sealed is not None:
        content = open_reasoning(sealed, f"{where}.encrypted_content")
    checked = {"type": "reasoning", "id": _item_id(item, "reasoning", where), "summary": summary}
    return checked | ({"content": content} if content else {})


def seal_reasoning(content: list[dict[str, Any]]) -> str:
    """A reasoning item's `encrypted_content`: its reasoning_text parts, opaque to the client
    and read back by `open_reasoning` on any worker. Not encrypted: the same item carries
    the text in `content` (this server never hides a model's reasoning from its caller), so
    secrecy would protect nothing; it is there for clients that replay reasoning with
    store=false through this field, as OpenAI's docs have them do."""
    payload = json.dumps({"v": 1, "content": content}, separators=(",", ":"))
    return SEAL_PREFIX + base64.urlsafe_b64encode(payload.encode()).decode()


def open_reasoning(value: Any, where: str) -> list[dict[str, Any]]:
    """The reasoning_text parts `seal_reasoning` wrote; a 400 naming `where` for anything
    else (another server's encrypted content included)."""
    try:
        if not isinstance(value, str) or not value.startswith(SEAL_PREFIX):
            raise ValueError("not this server's")
        payload = json.loads(base64.urlsafe_b64decode(value[len(SEAL_PREFIX) :]))
        content = payload["content"]
        if not all(_is_reasoning_part(part) for part in content):
            raise ValueError("not reasoning_text parts")
    except (ValueError, KeyError, TypeError) as exc:
        raise BadRequest(f"{where} was not written by this server ({exc})"[:200], where) from None
    return content


def _is_reasoning_part(part: Any) -> bool:
    return (
        isinstance(part, dict)
        and set(part) == {"type", "text"}
        and part["type"] == "reasoning_text"
        and isinstance(part["text"], str)
    )


# ---- items -> chat messages --------------------------------------------------------------


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized items as chat messages (see the module doc), in order."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items' text, for the assistant turn that follows
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning += [part["text"] for part in item.get("content", [])]
            continue
        if kind == "message":
            text = "\n".join(part["text"] for part in item["content"])
            messages.append({"role": ROLES[item["role"]], "content": text})
        elif kind == "function_call":
            _add_call(messages, item)
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        if reasoning and messages[-1]["role"] == "assistant":
            earlier = messages[-1].get("reasoning_content")  # a turn's calls each reasoned
            messages[-1] |= with_reasoning("\n".join([*([earlier] if earlier else []), *reasoning]))
        reasoning = []  # reasoning before any other turn reads to no one: dropped
    return messages


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """A call joins the assistant turn just before it, or opens one."""
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": json_object(item["arguments"])},
    }
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


# ---- lists of items ----------------------------------------------------------------------

DEFAULT_LIST_LIMIT = 20
MAX_LIST_LIMIT = 100


def check_list_query(query: Mapping[str, str], known: set[str]) -> None:
    """A list or get route's query: only `known` parameters (an empty `include` passes)."""
    for key, value in query.items():
        if key not in known and not (key == "include" and not value):
            raise BadRequest(f"query parameter {key} is not supported by this server", key)


def item_page(items: list[dict[str, Any]], query: Mapping[str, str], of: str) -> dict[str, Any]:
    """`items` as OpenAI's list routes page them: `order` (asc | desc, default desc), `after`
    (an item id of `of`, e.g. "this conversation"), `limit` (1-100, default 20)."""
    check_list_query(query, {"after", "limit", "order", "include"})
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be 'asc' or 'desc'; got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise BadRequest(f"after names no item of {of}: {after!r}", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    limit = query.get("limit", str(DEFAULT_LIST_LIMIT))
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST_LIMIT:
        message = f"limit must be an integer in [1, {MAX_LIST_LIMIT}]; got {limit!r}"
        raise BadRequest(message, param="limit")
    return list_body(ordered[: int(limit)], has_more=len(ordered) > int(limit))


def list_body(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list object of `items` (each with an id)."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
