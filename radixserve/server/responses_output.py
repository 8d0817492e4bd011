"""The Responses API's output: the Response object, its output items built from a choice's
deltas, the stream's events, and the usage.

Output items. A choice's deltas (openai_api.py's trackers: settled text, tool-call fragments
and completed calls) become items in order: text goes into the open `message` item (one
`output_text` part; a new item when text follows a call), each call is a `function_call`
item (`id` fc_..., `call_id` the parser's call_...). Streamed, an item is
`response.output_item.added`, then for a message `response.content_part.added`,
`response.output_text.delta`s, `response.output_text.done`, `response.content_part.done`;
for a call `response.function_call_arguments.delta`s (the first fragment carries the name,
in the added item) and `.done`; then `response.output_item.done`. With
`parallel_tool_calls: false` calls after the first are left out.

Status: "completed" (stop, tool calls), "incomplete" with `incomplete_details.reason`
"max_output_tokens" (length), "failed" with an `error` (aborted: engine gone, internal
error). The stream opens with response.created and response.in_progress and ends with
response.completed, response.incomplete or response.failed; every event has a
`sequence_number`, counting from 0.

Usage: `input_tokens` (the whole prompt), `input_tokens_details.cached_tokens` (served from
the radix cache), `cache_write_tokens` (the rest of the prompt, which the radix tree keeps
after the request), `output_tokens`, `output_tokens_details.reasoning_tokens`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.client.result import RequestResult
from radixserve.server.openai_response import Delta
from radixserve.server.responses_items import new_id, seal_reasoning
from radixserve.server.tool_calls import ToolCall, ToolCallDelta

Event = dict[str, Any]  # one stream event's data; its `type` is the SSE event name


def usage(result: RequestResult, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses usage of one request (see the module doc); `reasoning_tokens`: of the
    output, those its reasoning items hold."""
    num_prompt, num_output = result.prompt_len, len(result.output_ids)
    cached = min(result.cached_tokens, num_prompt)
    return {
        "input_tokens": num_prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": num_prompt - cached,
        },
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, num_output)},
        "total_tokens": num_prompt + num_output,
    }


def status_of(finish: str) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) from a tracker's finish ("stop", "tool_calls", "length")."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def error_event(message: str, code: str = "server_error") -> dict[str, Any]:
    """A Response's `error` (status "failed")."""
    return {"code": code, "message": message}


@dataclass
class OutputItems:
    """A response's output items built from a choice's deltas; `add` and `close` return the
    stream events for what changed (without sequence numbers: ResponseShape adds them)."""

    sealed_reasoning: bool = False  # include reasoning.encrypted_content
    items: list[dict[str, Any]] = field(default_factory=list)
    open_message: dict[str, Any] | None = None
    open_calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # parser index -> item
    open_reasoning: dict[str, Any] | None = None

    @property
    def reasoning_text(self) -> str:
        """All the reasoning items' text."""
        parts = [i["content"][0]["text"] for i in self.items if i["type"] == "reasoning"]
        return "".join(parts)

    def add(self, delta: Delta) -> list[Event]:
        events = self._add_reasoning(delta.reasoning) if delta.reasoning else []
        if delta.text or delta.tool_call_deltas or delta.tool_calls:
            events += self._close_reasoning()
        if delta.text:
            events += self._add_text(delta.text)
        for fragment in delta.tool_call_deltas:
            events += self._add_fragment(fragment)
        for call in delta.tool_calls:
            events += self._finish_call(call)
        return events

    def close(self) -> list[Event]:
        """Ends the open reasoning and message (at the end of the output)."""
        return self._close_reasoning() + self._close_message()

    def _add_reasoning(self, text: str) -> list[Event]:
        events = []
        item = self.open_reasoning
        if item is None:
            events += self._close_message()
            item = {
                "type": "reasoning",
                "id": new_id("rs_"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
            self.items.append(item)
            self.open_reasoning = item
            events.append(self._item_event("response.output_item.added", item))
        item["content"][0]["text"] += text
        events.append(self._reasoning_event("response.reasoning_text.delta", delta=text))
        return events

    def _close_reasoning(self) -> list[Event]:
        item = self.open_reasoning
        if item is None:
            return []
        text = item["content"][0]["text"]
        events = [self._reasoning_event("response.reasoning_text.done", text=text)]
        item["status"] = "completed"
        if self.sealed_reasoning:
            item["encrypted_content"] = seal_reasoning(item["content"])
        events.append(self._item_event("response.output_item.done", item))
        self.open_reasoning = None
        return events

    def _add_text(self, text: str) -> list[Event]:
        events = []
        if self.open_message is None:
            item = {
                "type": "message",
                "id": new_id("msg_"),
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            self.items.append(item)
            self.open_message = item
            events.append(self._item_event("response.output_item.added", item))
            item["content"].append({"type": "output_text", "text": "", "annotations": []})
            events.append(self._part_event("response.content_part.added"))
        self.open_message["content"][0]["text"] += text
        events.append(self._text_event("response.output_text.delta", delta=text))
        return events

    def _close_message(self) -> list[Event]:
        item = self.open_message
        if item is None:
            return []
        text = item["content"][0]["text"]
        events = [self._text_event("response.output_text.done", text=text)]
        events.append(self._part_event("response.content_part.done"))
        item["status"] = "completed"
        events.append(self._item_event("response.output_item.done", item))
        self.open_message = None
        return events

    def _add_fragment(self, fragment: ToolCallDelta) -> list[Event]:
        events = []
        item = self.open_calls.get(fragment.index)
        if item is None:
            events += self._close_message()
            item = self._open_call(fragment.index, fragment.id, fragment.name)
            events.append(self._item_event("response.output_item.added", item))
        if fragment.arguments:
            item["arguments"] += fragment.arguments
            events.append(
                self._call_event(
                    "response.function_call_arguments.delta", item, delta=fragment.arguments
                )
            )
        return events

    def _open_call(self, index: int, call_id: str | None, name: str | None) -> dict[str, Any]:
        item = {
            "type": "function_call",
            "id": new_id("fc_"),
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        self.open_calls[index] = item
        return item

    def _finish_call(self, call: ToolCall) -> list[Event]:
        """A completed call: its item (opened by its fragments, or now) gets its whole
        arguments."""
        events = []
        item = self.open_calls.pop(call.index, None)
        if item is None:  # a whole output's call: no fragments were streamed
            events += self._close_message()
            item = self._open_call(call.index, call.id, call.name)
            self.open_calls.pop(call.index)
            events.append(self._item_event("response.output_item.added", item))
        item["arguments"], item["status"] = call.arguments, "completed"
        events.append(
            self._call_event(
                "response.function_call_arguments.done", item, arguments=call.arguments
            )
        )
        events.append(self._item_event("response.output_item.done", item))
        return events

    # ---- events ----

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, known in enumerate(self.items) if known is item)

    def _item_event(self, kind: str, item: dict[str, Any]) -> Event:
        snapshot = (
            item | {"content": [dict(p) for p in item["content"]]}
            if "content" in item
            else dict(item)
        )
        return {"type": kind, "output_index": self._index(item), "item": snapshot}

    def _part_event(self, kind: str) -> Event:
        item = self.open_message
        return {
            "type": kind,
            "item_id": item["id"],
            "output_index": self._index(item),
            "content_index": 0,
            "part": dict(item["content"][0]),
        }

    def _text_event(self, kind: str, **text: str) -> Event:
        item = self.open_message
        return {
            "type": kind,
            "item_id": item["id"],
            "output_index": self._index(item),
            "content_index": 0,
            "logprobs": [],
        } | text

    def _reasoning_event(self, kind: str, **text: str) -> Event:
        item = self.open_reasoning
        return {
            "type": kind,
            "item_id": item["id"],
            "output_index": self._index(item),
            "content_index": 0,
        } | text

    def _call_event(self, kind: str, item: dict[str, Any], **text: str) -> Event:
        return {"type": kind, "item_id": item["id"], "output_index": self._index(item)} | text


class ResponseShape:
    """The Response object of one request (its settings echoed from `echo`), and its stream
    events numbered in order."""

    def __init__(self, model: str, echo: dict[str, Any]):
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        self.model = model
        self.echo = echo
        self.sequence_number = 0

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: dict[str, str] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage if done else None,
            "background": False,
            "service_tier": "default",
            "reasoning": {"effort": None, "summary": None},
        } | self.echo

    def event(self, event: Event) -> Event:
        """`event` with the next sequence number."""
        numbered = event | {"sequence_number": self.sequence_number}
        self.sequence_number += 1
        return numbered

    def lifecycle_event(self, kind: str, response: dict[str, Any]) -> Event:
        """response.created / in_progress / completed / incomplete / failed."""
        return self.event({"type": kind, "response": response})
