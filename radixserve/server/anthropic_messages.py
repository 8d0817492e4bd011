"""Anthropic's `system` and `messages`, checked block by block and converted to the
chat-completions message list that chat_prompt.py renders (one template path for both APIs).

    system (string or text blocks)        -> {"role": "system", "content": text}
    user text blocks                      -> {"role": "user", "content": text}
    user tool_result blocks               -> {"role": "tool", "tool_call_id", "content"}
    assistant text + tool_use blocks      -> {"role": "assistant", "content", "tool_calls"}
    assistant thinking blocks             -> the turn's reasoning (`reasoning_content`: the
                                             chat template keeps or drops it, as Qwen3's
                                             keeps it after the last user turn); redacted
                                             thinking is left out

Text blocks of one turn are joined with "\n" (as chat completions joins text parts); a
tool_result's content may be a string or text blocks, and `is_error: true` prefixes it with
ERROR_PREFIX so the model sees the failure. Blocks keep their order: text before a
tool_result becomes its own user turn ahead of the tool turn.

`cache_control` is accepted on every block (the radix cache caches every prefix anyway); the
conversation up to the last block that carries one is kept, so that the usage can report the
tokens written at that breakpoint (`cache_creation_input_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.server.chat_messages import with_reasoning
from radixserve.server.errors import BadRequest
from radixserve.server.request_fields import check_fields

ROLES = ("user", "assistant")
ERROR_PREFIX = "Error: "
"""How a tool_result with `is_error: true` reads to the model."""
BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control", "caller"},  # caller: metadata
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature", "cache_control"},
    "redacted_thinking": {"type", "data", "cache_control"},
}
ROLE_BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}
THINKING_BLOCKS = ("thinking", "redacted_thinking")
"""An earlier turn's reasoning: accepted and left out of the prompt, as Anthropic does."""
UNSUPPORTED_BLOCKS = {
    "image",
    "document",
    "search_result",
    "server_tool_use",
    "web_search_tool_result",
    "container_upload",
}
CACHE_TTLS = ("5m", "1h")


@dataclass
class Conversation:
    """Chat messages built from a Messages request, and the messages up to its last
    cache_control breakpoint (None: no block carries one)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    breakpoint: list[dict[str, Any]] | None = None

    def mark(self, pending: dict[str, Any] | None = None) -> None:
        """A breakpoint here: the messages so far, the turn being built included."""
        self.breakpoint = [*self.messages, *([pending] if pending else [])]


def convert_conversation(system: Any, messages: Any, conversation: Conversation) -> None:
    """Appends `system` and `messages` to `conversation`, checking every block."""
    if system is not None:
        _add_system(system, conversation)
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of message objects", "messages")
    for i, message in enumerate(messages):
        _add_message(message, f"messages[{i}]", conversation)


# ---- system ------------------------------------------------------------------------------


def _add_system(system: Any, conversation: Conversation) -> None:
    if isinstance(system, str):
        conversation.messages.append({"role": "system", "content": system})
        return
    if not isinstance(system, list):
        raise BadRequest(
            f"system must be a string or a list of text blocks; got {system!r}"[:160], "system"
        )
    texts: list[str] = []
    for j, block in enumerate(system):
        block = check_block(block, f"system[{j}]", ("text",))
        texts.append(block["text"])
        if block.get("cache_control") is not None:
            conversation.mark({"role": "system", "content": "\n".join(texts)})
    conversation.messages.append({"role": "system", "content": "\n".join(texts)})


# ---- messages ----------------------------------------------------------------------------


def _add_message(message: Any, where: str, conversation: Conversation) -> None:
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object; got {message!r}"[:160], param=where)
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {ROLES}; got {role!r}", f"{where}.role")
    check_fields(message, {"role", "content"}, {}, where, of="a message")
    content = message.get("content")
    if isinstance(content, str):
        conversation.messages.append({"role": role, "content": content})
    elif isinstance(content, list):
        _add_blocks(role, content, f"{where}.content", conversation)
    else:
        raise BadRequest(
            f"{where}.content must be a string or a list of content blocks; got {content!r}"[:160],
            param=f"{where}.content",
        )


def _add_blocks(role: str, blocks: list, where: str, conversation: Conversation) -> None:
    """One turn's blocks, in order: text and tool_use build the turn; a tool_result ends the
    text before it and becomes a tool turn."""
    turn = _Turn(role)
    for j, block in enumerate(blocks):
        block = check_block(block, f"{where}[{j}]", ROLE_BLOCKS[role])
        if block["type"] == "tool_result":
            turn.flush_into(conversation)
            conversation.messages.append(_tool_result(block, f"{where}[{j}]"))
        elif block["type"] == "tool_use":
            turn.calls.append(_tool_use(block, f"{where}[{j}]"))
        elif block["type"] == "thinking":
            turn.reasoning.append(block["thinking"])
        elif block["type"] in THINKING_BLOCKS:
            pass  # redacted: nothing this server could read
        else:
            turn.texts.append(block["text"])
        if block.get("cache_control") is not None:
            conversation.mark(turn.message())
    turn.flush_into(conversation, keep_empty=not blocks)


class _Turn:
    """A user or assistant turn being built from its blocks."""

    def __init__(self, role: str):
        self.role = role
        self.texts: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.reasoning: list[str] = []

    def message(self) -> dict[str, Any] | None:
        if not self.texts and not self.calls:
            return None
        message = {"role": self.role, "content": "\n".join(self.texts)}
        if self.reasoning:
            message |= with_reasoning("\n".join(self.reasoning))
        return message | {"tool_calls": list(self.calls)} if self.calls else message

    def flush_into(self, conversation: Conversation, keep_empty: bool = False) -> None:
        message = self.message() or ({"role": self.role, "content": ""} if keep_empty else None)
        if message is not None:
            conversation.messages.append(message)
        self.texts, self.calls = [], []


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A past call, as chat messages hold it (arguments decoded)."""
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    for key, value, kind in (("id", call_id, str), ("name", name, str), ("input", arguments, dict)):
        if not isinstance(value, kind):
            noun = "an object" if kind is dict else "a string"
            raise BadRequest(f"{where}.{key} must be {noun}; got {value!r}"[:160], f"{where}.{key}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise BadRequest(
            f"{where}.tool_use_id must be a string; got {call_id!r}"[:160], f"{where}.tool_use_id"
        )
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise BadRequest(
            f"{where}.is_error must be true or false; got {is_error!r}", f"{where}.is_error"
        )
    text = _result_text(block.get("content"), f"{where}.content")
    return {
        "role": "tool",
        "tool_call_id": call_id,
        "content": ERROR_PREFIX + text if is_error else text,
    }


def _result_text(content: Any, where: str) -> str:
    """A tool_result's content: absent, a string, or text blocks (joined with newlines)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(
            f"{where} must be a string or a list of text blocks; got {content!r}"[:160], where
        )
    return "\n".join(
        check_block(b, f"{where}[{k}]", ("text",))["text"] for k, b in enumerate(content)
    )


# ---- blocks ------------------------------------------------------------------------------


def check_block(block: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A content block of one of the `allowed` types, with only its own fields."""
    if not isinstance(block, dict):
        raise BadRequest(f"{where} must be a content block object; got {block!r}"[:160], where)
    kind = block.get("type")
    if kind not in allowed:
        reason = "is unknown"
        if isinstance(kind, str) and kind in UNSUPPORTED_BLOCKS:  # (a list is no dict key)
            reason = "is not supported by this server"
        elif isinstance(kind, str) and kind in BLOCK_KEYS:
            reason = "is not allowed here"
        message = f"{where}.type {kind!r} {reason}; expected one of {allowed}"
        raise BadRequest(message[:200], f"{where}.type")
    check_fields(block, BLOCK_KEYS[kind], {}, where, of=f"a {kind} block")
    text_key = {"text": "text", "thinking": "thinking"}.get(kind)
    if text_key is not None and not isinstance(block.get(text_key), str):
        got = block.get(text_key)
        raise BadRequest(
            f"{where}.{text_key} must be a string; got {got!r}"[:160], f"{where}.{text_key}"
        )
    if block.get("citations") is not None:
        raise BadRequest(f"{where}.citations is not supported by this server", f"{where}.citations")
    check_cache_control(block.get("cache_control"), f"{where}.cache_control")
    return block


def check_cache_control(value: Any, where: str) -> None:
    """`{"type": "ephemeral"}`, optionally with a `ttl` of "5m" or "1h"; or absent."""
    if value is None:
        return
    shaped = isinstance(value, dict) and value.get("type") == "ephemeral"
    if not shaped or set(value) - {"type", "ttl"} or value.get("ttl", "5m") not in CACHE_TTLS:
        raise BadRequest(
            f"{where} must be {{'type': 'ephemeral', 'ttl': '5m' | '1h'}}; got {value!r}"[:160],
            param=where,
        )
