"""OpenAI's response bodies and stream chunks for /v1/completions and /v1/chat/completions:
choices, logprobs in each endpoint's shape, usage."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from radixserve.client.result import RequestResult
from radixserve.server.openai_protocol import OpenAIRequest
from radixserve.server.tool_calls import ToolCall, ToolCallDelta

MIN_LOGPROB = -9999.0
"""OpenAI's floor for a logprob: JSON has no -Infinity."""


class TokenLogprob(NamedTuple):
    """One token's logprob; `top` is None for the first echoed prompt token."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None
    text_offset: int


@dataclass
class Delta:
    """What one choice gained since the last response or chunk: text (the content, when a
    reasoning parser split it), the tool calls that completed, the tool-call fragments a
    stream sends, and reasoning (None: no parser separates it)."""

    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str | None = None
    token_ids: list[int] | None = None  # the output ids since the last delta, when asked


class ResponseShape:
    """Builds the response bodies and stream chunks of one request in OpenAI's shapes."""

    def __init__(
        self, parsed: OpenAIRequest, model: str, prompt_ids: list[list[int]] | None = None
    ):
        """`prompt_ids`: each prompt's token ids, given when vLLM's return_token_ids asks for
        them (and each choice's output ids then come in its deltas' `token_ids`)."""
        self.chat = parsed.chat
        self.with_logprobs = parsed.logprobs is not None
        self.top_limit = parsed.logprobs or 0  # output alternatives shown (prompt_logprobs' k
        # may have made the core compute more)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.prompt_ids = prompt_ids
        self.n = parsed.n
        self._unstarted = set(range(len(prompt_ids) * parsed.n)) if prompt_ids else set()

    def response(
        self, deltas: list[Delta], usage: dict[str, Any], scored: list[list] | None = None
    ) -> dict[str, Any]:
        """The whole response; `scored`: each choice's prompt_logprobs (vLLM's), when asked."""
        choices = [self._choice(i, delta, chunk=False) for i, delta in enumerate(deltas)]
        body = self._head(chunk=False) | {"choices": choices, "usage": usage}
        if self.chat and self.prompt_ids is not None:  # vLLM's: the response's, once
            body["prompt_token_ids"] = self.prompt_ids[0]
        if scored is not None and self.chat:
            body["prompt_logprobs"] = scored[0]
        elif scored is not None:
            for choice, entries in zip(choices, scored):
                choice["prompt_logprobs"] = entries
        return body

    def chunk(self, index: int, delta: Delta) -> dict[str, Any]:
        return self._head(chunk=True) | {"choices": [self._choice(index, delta, chunk=True)]}

    def role_chunk(self, index: int) -> dict[str, Any]:
        """The first chunk of a chat choice: the assistant's role, no content yet (and the
        prompt's ids in the stream's first chunk, when asked)."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}  # fmt: skip
        body = self._head(chunk=True) | {"choices": [choice]}
        if self.prompt_ids is not None and index == 0:
            body["prompt_token_ids"] = self.prompt_ids[0]
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._head(chunk=True) | {"choices": [], "usage": usage}

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "text_completion"
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, index: int, delta: Delta, chunk: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if not self.chat:
            choice["text"] = delta.text
        elif chunk:
            choice["delta"] = {"content": delta.text} if delta.text else {}
            if delta.reasoning:
                choice["delta"]["reasoning_content"] = delta.reasoning
            if delta.tool_call_deltas:
                choice["delta"]["tool_calls"] = [c.to_openai() for c in delta.tool_call_deltas]
        else:
            choice["message"] = chat_message(delta)
        choice["logprobs"] = self._logprobs(delta.logprobs)
        choice["finish_reason"] = delta.finish_reason
        if delta.token_ids is not None:
            choice["token_ids"] = delta.token_ids
        if (
            not self.chat
            and self.prompt_ids is not None
            and (not chunk or index in self._unstarted)
        ):
            self._unstarted.discard(index)  # a completion choice's: in its first chunk
            choice["prompt_token_ids"] = self.prompt_ids[index // self.n]
        return choice

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        entries = [e._replace(top=e.top[: self.top_limit]) if e.top else e for e in entries]
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries)


def chat_message(delta: Delta) -> dict[str, Any]:
    """A whole chat choice's message; with tool calls, empty content is null (as OpenAI);
    separated reasoning is `reasoning_content` (null when there was none)."""
    message: dict[str, Any] = {"role": "assistant", "content": delta.text}
    if delta.reasoning is not None:
        message["reasoning_content"] = delta.reasoning or None
    if delta.tool_calls:
        message["content"] = delta.text or None
        message["tool_calls"] = [call.to_openai() for call in delta.tool_calls]
    return message


def completion_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """/v1/completions logprobs; each top dict also holds the sampled token (as vLLM)."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else dict(e.top) | {e.token: e.logprob}
                         for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }  # fmt: skip


def logprob_item(token: str, logprob: float | None) -> dict[str, Any]:
    """One token's logprob as chat completions (and Ollama) write it, with its UTF-8 bytes."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """/v1/chat/completions logprobs: exactly `top_logprobs` alternatives per token."""
    return {
        "content": [
            logprob_item(e.token, e.logprob)
            | {"top_logprobs": [logprob_item(t, v) for t, v in e.top or []]}
            for e in entries
        ]
    }


def prompt_logprobs(results: list[RequestResult], tokenizer) -> list[list]:
    """vLLM's prompt_logprobs of each choice: None for the first prompt token (nothing
    predicts it), then per position {token id: {"logprob", "rank", "decoded_token"}}, the
    prompt's token first (its rank among the vocabulary), then the top k (ranks 1..k)."""
    return [_prompt_entries(result, tokenizer) for result in results]


def _prompt_entries(result: RequestResult, tokenizer) -> list:
    entries: list = [None]
    scored = zip(result.input_logprobs[1:], result.input_top_logprobs[1:], result.input_ranks[1:])
    for (value, token), tops, rank in scored:
        position = {str(token): _scored(value, rank, token, tokenizer)}
        for i, (top_value, top_token) in enumerate(tops or []):
            position.setdefault(str(top_token), _scored(top_value, i + 1, top_token, tokenizer))
        entries.append(position)
    return entries[: max(result.prompt_len, 1)]


def _scored(value: float, rank: int, token: int, tokenizer) -> dict[str, Any]:
    return {"logprob": max(value, MIN_LOGPROB), "rank": rank,
            "decoded_token": tokenizer.decode([token])}  # fmt: skip


def usage(results: list[RequestResult], n: int) -> dict[str, int | dict[str, int]]:
    """Token counts; a prompt sampled n times (results p*n .. p*n+n-1) counts once."""
    num_prompt = sum(r.prompt_len for r in results[::n])
    num_completion = sum(len(r.output_ids) for r in results)
    groups = range(0, len(results), n)
    num_cached = sum(max(r.cached_tokens for r in results[i : i + n]) for i in groups)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }
