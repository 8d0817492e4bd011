"""Anthropic's response shapes for /v1/messages: the message body, its usage and stop reason,
the stream's events, and the error body.

Content. A choice's deltas (openai_api.py's trackers: reasoning, settled text, tool calls)
become content blocks in order: reasoning goes into a `thinking` block (with a reasoning
parser on; `thinking_delta` events, an empty `signature`), text into the open text block
(one is opened when text follows another block), each call is a `tool_use` block. A message
with no block gets one empty text block, so `content[0]` always exists. Streamed, a tool_use
block is `content_block_start` with `input: {}`, an `input_json_delta` per argument fragment
as the tool parser reads it (concatenated: the arguments JSON), then `content_block_stop`.

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
from radixserve.server.tool_calls import ToolCall, ToolCallDelta

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
"""Anthropic's error types by status; any other 4xx (405, 408, 409, 415, 422, ...) is an
invalid_request_error, as Anthropic's docs type the 4xx they list no type for, and any
other 5xx an api_error."""
Event = tuple[str, dict[str, Any]]  # (event name, data)


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape; the type follows the HTTP status (ERROR_TYPES)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
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
    stream events for what changed (disable_parallel_tool_use's calls after the first never
    reach it: choice_trackers.chat_tracker drops them)."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.open_kind: str | None = None  # the open block's type
        self.open_call: int | None = None  # the call index of an open tool_use block
        self.streamed: dict[int, tuple[int, str]] = {}  # call index -> (block, JSON sent)

    def add(self, delta: Delta) -> list[Event]:
        events = self._add_run("thinking", delta.reasoning) if delta.reasoning else []
        deltas, calls = delta.tool_call_deltas, delta.tool_calls
        current = self.open_call
        if current is not None:  # what ends the open call comes before any new text
            events += self._add_calls([d for d in deltas if d.index == current],
                                      [c for c in calls if c.index == current])  # fmt: skip
            deltas = [d for d in deltas if d.index != current]
            calls = [c for c in calls if c.index != current]
        events += self._add_run("text", delta.text) if delta.text else []
        return events + self._add_calls(deltas, calls)

    def close(self) -> list[Event]:
        """Ends the open block; a message without any gets one empty text block."""
        if not self.blocks:
            return self._add_run("text", "") + self._close()
        return self._close()

    def _add_calls(self, deltas: list[ToolCallDelta], calls: list[ToolCall]) -> list[Event]:
        events = [event for d in deltas for event in self._add_fragment(d)]
        for call in calls:
            if call.index in self.streamed:
                events += self._end_streamed(call)
            else:
                events += self._add_call(call.id, call.name, call.arguments)
        return events

    def _open(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.blocks.append(block)
        self.open_kind = block["type"]
        return [*events, _block_start(len(self.blocks) - 1, dict(block))]

    def _close(self) -> list[Event]:
        if self.open_kind is None:
            return []
        self.open_kind, self.open_call = None, None
        return [_block_stop(len(self.blocks) - 1)]

    def _add_run(self, kind: str, text: str) -> list[Event]:
        """Text or thinking, appended to the open block of that kind (opened if needed)."""
        events: list[Event] = []
        if self.open_kind != kind:
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            events += self._open(block)
        self.blocks[-1][kind] += text
        if text:
            events.append(_block_delta(len(self.blocks) - 1, {"type": f"{kind}_delta", kind: text}))
        return events

    def _add_fragment(self, fragment: ToolCallDelta) -> list[Event]:
        """A streamed call: its first fragment opens a tool_use block, each one after it is
        an input_json_delta."""
        events: list[Event] = []
        if fragment.id is not None:
            block_id = "toolu_" + fragment.id.removeprefix("call_")
            events += self._open({"type": "tool_use", "id": block_id, "name": fragment.name,
                                  "input": {}})  # fmt: skip
            self.open_call = fragment.index
            self.streamed[fragment.index] = (len(self.blocks) - 1, "")
        return events + self._send_json(fragment.index, fragment.arguments)

    def _send_json(self, call_index: int, text: str) -> list[Event]:
        index, sent = self.streamed[call_index]
        if not text or self.open_call != call_index:
            return []
        self.streamed[call_index] = (index, sent + text)
        return [_block_delta(index, {"type": "input_json_delta", "partial_json": text})]

    def _end_streamed(self, call: ToolCall) -> list[Event]:
        index, sent = self.streamed[call.index]
        rest = call.arguments[len(sent) :] if call.arguments.startswith(sent) else ""
        events = self._send_json(call.index, rest)
        self.blocks[index]["input"] = json.loads(call.arguments)
        return events + (self._close() if self.open_call == call.index else [])

    def _add_call(self, call_id: str, name: str, arguments: str) -> list[Event]:
        """A whole call (not streamed): its block with the whole arguments in one delta."""
        block_id = "toolu_" + call_id.removeprefix("call_")
        events = self._open({"type": "tool_use", "id": block_id, "name": name, "input": {}})
        self.blocks[-1]["input"] = json.loads(arguments)
        index = len(self.blocks) - 1
        delta = {"type": "input_json_delta", "partial_json": arguments}
        return [*events, _block_delta(index, delta), *self._close()]


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
