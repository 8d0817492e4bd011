"""Anthropic's response shapes for /v1/messages: the message body, its usage and stop reason,
the stream's events, and the error body.

Content. A choice's deltas (openai_api.py's trackers: settled text, complete tool calls)
become content blocks in order: text goes into the open text block (one is opened when text
follows a call), each call is a `tool_use` block. A message with no block gets one empty text
block, so `content[0]` always exists. Streamed, a tool_use block is `content_block_start`
with `input: {}`, one `input_json_delta` carrying the whole arguments JSON, then
`content_block_stop` (the parser yields whole calls).

Usage, as Anthropic counts it (the three input counts add up to the prompt):
- `cache_read_input_tokens`: prompt tokens served from the radix cache;
- `cache_creation_input_tokens`: 0 without a cache_control block; else the prompt tokens up
  to the last breakpoint that were not read from the cache (they are written to it now);
- `input_tokens`: the rest of the prompt.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.client.result import RequestResult
from radixserve.server.openai_response import Delta

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
Event = tuple[str, dict[str, Any]]  # (event name, data)


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape; the type follows the HTTP status (api_error otherwise)."""
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass(frozen=True)
class PromptTokens:
    """A rendered prompt: its token ids and where its last cache_control breakpoint ends
    (in tokens; None without one)."""

    ids: list[int]
    breakpoint_len: int | None = None


def usage(result: RequestResult, prompt: PromptTokens) -> dict[str, int]:
    """Anthropic's usage for one request (see the module doc)."""
    num_prompt = result.prompt_len
    read = min(result.cached_tokens, num_prompt)
    written = 0 if prompt.breakpoint_len is None else max(prompt.breakpoint_len - read, 0)
    return {
        "input_tokens": num_prompt - read - written,
        "output_tokens": len(result.output_ids),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
    }


def stop_reason(result: RequestResult, finish: str) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from a tracker's finish ("stop", "length", "tool_calls")."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    matched = result.finish_reason.matched if result.finish_reason is not None else None
    if isinstance(matched, str) and matched in result.spec.params.stop_strs:
        return "stop_sequence", matched
    return "end_turn", None


class MessageShape:
    """The bodies and events of one message."""

    def __init__(self, model: str):
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model

    def message(
        self,
        content: list[dict[str, Any]],
        stop: tuple[str, str | None] | None,
        usage: dict[str, int],
    ) -> dict[str, Any]:
        reason, sequence = stop if stop is not None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    def start_event(self, usage: dict[str, int]) -> Event:
        return "message_start", {"type": "message_start", "message": self.message([], None, usage)}

    def delta_event(self, stop: tuple[str, str | None], usage: dict[str, int]) -> Event:
        """The stop reason, and the usage's final totals (Anthropic's are cumulative)."""
        delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
        return "message_delta", {"type": "message_delta", "delta": delta, "usage": usage}

    @staticmethod
    def stop_event() -> Event:
        return "message_stop", {"type": "message_stop"}


class ContentBlocks:
    """A message's content blocks built from a choice's deltas; `add` and `close` return the
    stream events for what changed. With `single_tool_use`, calls after the first are left
    out (disable_parallel_tool_use)."""

    def __init__(self, single_tool_use: bool = False):
        self.blocks: list[dict[str, Any]] = []
        self.single_tool_use = single_tool_use
        self.text_open = False
        self.num_calls = 0

    def add(self, delta: Delta) -> list[Event]:
        events = self._add_text(delta.text) if delta.text else []
        for call in delta.tool_calls:
            if self.single_tool_use and self.num_calls:
                break
            events += self._close_text()
            events += self._add_call(call.id, call.name, call.arguments)
        return events

    def close(self) -> list[Event]:
        """Ends the open block; a message without any gets one empty text block."""
        if not self.blocks:
            return self._add_text("") + self._close_text()
        return self._close_text()

    def _add_text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self.text_open:
            self.blocks.append({"type": "text", "text": ""})
            self.text_open = True
            events.append(_block_start(len(self.blocks) - 1, {"type": "text", "text": ""}))
        self.blocks[-1]["text"] += text
        if text:
            delta = {"type": "text_delta", "text": text}
            events.append(_block_delta(len(self.blocks) - 1, delta))
        return events

    def _close_text(self) -> list[Event]:
        if not self.text_open:
            return []
        self.text_open = False
        return [_block_stop(len(self.blocks) - 1)]

    def _add_call(self, call_id: str, name: str, arguments: str) -> list[Event]:
        self.num_calls += 1
        block_id = "toolu_" + call_id.removeprefix("call_")
        block = {"type": "tool_use", "id": block_id, "name": name}
        self.blocks.append(block | {"input": json.loads(arguments)})
        index = len(self.blocks) - 1
        delta = {"type": "input_json_delta", "partial_json": arguments}
        return [
            _block_start(index, block | {"input": {}}),
            _block_delta(index, delta),
            _block_stop(index),
        ]


def _block_start(index: int, block: dict[str, Any]) -> Event:
    return "content_block_start", {
        "type": "content_block_start",
        "index": index,
        "content_block": block,
    }


def _block_delta(index: int, delta: dict[str, Any]) -> Event:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _block_stop(index: int) -> Event:
    return "content_block_stop", {"type": "content_block_stop", "index": index}
