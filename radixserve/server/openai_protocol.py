"""OpenAI's wire format: /v1/completions and /v1/chat/completions bodies in, responses out.

Field names follow OpenAI, plus vLLM's and SGLang's extra sampling fields (`regex`,
`json_schema`, `ebnf` constrain the output, like `response_format`; one constraint at most:
see response_format.py).
A field this server does not know is rejected when it carries a value (null is fine), so
nothing is silently accepted and ignored, except `user` and `parallel_tool_calls` (as in vLLM).
Tools: see tool_calls.py.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from radixserve.client.request_builder import BOOTSTRAP_FIELDS
from radixserve.client.result import RequestResult
from radixserve.engine.request import MAX_LOGPROBS
from radixserve.server.errors import BadRequest
from radixserve.server.response_format import CONSTRAINT_FIELDS, output_constraint
from radixserve.server.tool_calls import (
    ToolCall,
    ToolChoice,
    check_message_tool_calls,
    check_tool_choice,
    check_tools,
)

MAX_TEMPERATURE = 2.0
"""OpenAI's upper bound on temperature, which vLLM's OpenAI server keeps; SGLang's has none."""

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name")
ROLE_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}
MIN_LOGPROB = -9999.0
"""OpenAI's floor for a logprob: JSON has no -Infinity."""

# Fields copied into SamplingParams under the same name.
SAMPLING_FIELDS = (
    "temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "top_k",
    "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "no_stop_trim", "speculative",
)  # fmt: skip
# SGLang's priority and session_id, retention (ours) and the bootstrap fields sglang-router's
# PD mode writes: extra body fields, passed on as on /generate.
EXTRA_GENERATE_FIELDS = ("priority", "session_id", "retention", *BOOTSTRAP_FIELDS)
COMMON_FIELDS = {
    *SAMPLING_FIELDS, "model", "max_tokens", "seed", "min_tokens", "logprobs", "stream",
    "stream_options", "cache_salt", "user", "response_format", *CONSTRAINT_FIELDS,
    *EXTRA_GENERATE_FIELDS,
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
    "parallel_tool_calls", "tools", "tool_choice",
}  # fmt: skip
TOKENIZE_FIELDS = {
    "model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
    "chat_template_kwargs",
}  # fmt: skip

# Fields this server does not implement: accepted only at their no-op value. Besides OpenAI's,
# the SGLang extensions that sglang-router writes into every body it forwards, at its defaults
# (it re-serializes requests; without a reasoning parser, separating reasoning is a no-op).
NO_OP_VALUES: dict[str, Any] = {
    "best_of": 1, "logit_bias": {}, "suffix": "",
    "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
    "return_hidden_states": False,
}  # fmt: skip


def bad_request(message: str, param: str | None = None) -> ValueError:
    """The server's 400 error, naming the offending field."""
    return BadRequest(message, param=param)


@dataclass
class OpenAIRequest:
    """A validated completion or chat completion request, before tokenization."""

    chat: bool
    model: str | None
    sampling: dict[str, Any]
    prompt: list[str] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    echo: bool = False
    cache_salt: Any = None
    extra_args: dict[str, Any] = field(default_factory=dict)  # EXTRA_GENERATE_FIELDS given
    max_tokens_name: str = "max_tokens"
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = ToolChoice("none")

    @property
    def n(self) -> int:
        return self.sampling.get("n", 1)

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: none when tool_choice is "none"."""
        return self.tools if self.tool_choice.mode != "none" else None

    def openai_message(self, message: str) -> str:
        """A core validation message with SGLang's field names turned into OpenAI's."""
        names = {
            "max_new_tokens": self.max_tokens_name,
            "min_new_tokens": "min_tokens",
            "sampling_seed": "seed",
            "input_ids": "prompt token ids",
        }
        return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m.group(1)], message)


def parse_request(body: Any, chat: bool) -> OpenAIRequest:
    """Validates a /v1/completions (chat=False) or /v1/chat/completions body."""
    body = check_object(body)
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    stream = check_bool(body, "stream")
    check_temperature(body)
    parsed = OpenAIRequest(
        chat=chat,
        model=check_model(body),
        sampling=sampling_dict(body),
        stream=stream,
        include_usage=check_stream_options(body.get("stream_options"), stream),
        cache_salt=body.get("cache_salt"),
        extra_args={name: body[name] for name in EXTRA_GENERATE_FIELDS if name in body},
    )
    if chat:
        _parse_chat(body, parsed)
    else:
        _parse_completion(body, parsed)
    constraint = output_constraint(body, parsed.tools, parsed.tool_choice)
    if constraint is not None:
        parsed.sampling[constraint.kind] = constraint.spec
    return parsed


def _parse_completion(body: dict, parsed: OpenAIRequest) -> None:
    parsed.prompt = check_prompt(body.get("prompt"))
    parsed.logprobs = check_top_count(body, "logprobs")
    parsed.echo = check_bool(body, "echo")


def _parse_chat(body: dict, parsed: OpenAIRequest) -> None:
    parsed.messages = check_messages(body.get("messages"))
    parsed.template_kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    top = check_top_count(body, "top_logprobs")
    if check_bool(body, "logprobs"):
        parsed.logprobs = top or 0
    elif top:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if body.get("max_completion_tokens") is not None:
        parsed.sampling["max_new_tokens"] = body["max_completion_tokens"]
        parsed.max_tokens_name = "max_completion_tokens"
    parsed.tools = check_tools(body.get("tools"))
    parsed.tool_choice = check_tool_choice(body.get("tool_choice"), parsed.tools)


def sampling_dict(body: dict) -> dict[str, Any]:
    """OpenAI's sampling fields under SamplingParams' names; absent and null fields left out."""
    params = {name: body.get(name) for name in SAMPLING_FIELDS}
    params["max_new_tokens"] = body.get("max_tokens")
    params["min_new_tokens"] = body.get("min_tokens")
    params["sampling_seed"] = body.get("seed")
    return {name: value for name, value in params.items() if value is not None}


# ---- field checks ------------------------------------------------------------------------


def check_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", param="body")
    return body


def check_fields(body: dict, known: set[str]) -> None:
    """Rejects any field that is unknown or unsupported, unless it is null or a no-op."""
    for key, value in body.items():
        if value is None or key in known:
            continue
        if key in NO_OP_VALUES and is_same_value(value, NO_OP_VALUES[key]):
            continue
        reason = (
            "is not supported by this server" if key in NO_OP_VALUES else "is not a known field"
        )
        raise bad_request(f"{key} {reason}; got {value!r}", param=key)


def is_same_value(value: Any, expected: Any) -> bool:
    """Equal and of the same type: 1 is not true, 0 is not false."""
    return type(value) is type(expected) and value == expected


def check_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false; got {value!r}", param=name)
    return value


def check_model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string; got {model!r}", param="model")
    return model


def check_temperature(body: dict) -> None:
    """temperature, when given, is a number in [0, MAX_TEMPERATURE]."""
    value = body.get("temperature")
    if value is None:
        return
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not 0 <= value <= MAX_TEMPERATURE:
        raise bad_request(
            f"temperature must be a number in [0, {MAX_TEMPERATURE:g}]; got {value!r}",
            param="temperature",
        )


def check_top_count(body: dict, name: str) -> int | None:
    """A logprobs count in [0, MAX_LOGPROBS], or None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(
            f"{name} must be an integer in [0, {MAX_LOGPROBS}]; got {value!r}", param=name
        )
    return value


def check_stream_options(options: Any, stream: bool) -> bool:
    """`stream_options.include_usage`; the options are only allowed on a stream."""
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    shaped = isinstance(options, dict) and not set(options) - {"include_usage"}
    if not shaped or not isinstance(options.get("include_usage", False), (bool, type(None))):
        raise bad_request(
            f"stream_options must be {{'include_usage': bool}}; got {options!r}", "stream_options"
        )
    return bool(options.get("include_usage"))


def check_prompt(prompt: Any) -> list[str] | list[list[int]]:
    """A string, strings, token ids or lists of token ids, as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(_is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return prompt
    raise bad_request(
        "prompt must be a string, a non-empty list of strings, a list of token ids or a list "
        f"of such lists; got {str(prompt)[:80]}",
        param="prompt",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- chat messages -----------------------------------------------------------------------


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: role, string content, optional name; an
    assistant's tool_calls (content optional) and a tool result's tool_call_id."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of message objects", "messages")
    return [_check_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _check_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object; got {message!r}", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {ROLES}; got {role!r}", f"{where}.role")
    for key, value in message.items():
        if key not in MESSAGE_KEYS + ROLE_KEYS.get(role, ()) and value is not None:
            raise bad_request(f"{where}.{key} is not supported by this server", f"{where}.{key}")
    checked = {"role": role} | _tool_fields(message, where)
    content = message.get("content")
    has_calls = "tool_calls" in checked
    checked["content"] = "" if content is None and has_calls else _content_text(content, where)
    if message.get("name") is not None:
        checked["name"] = _check_str(message["name"], f"{where}.name")
    return checked


def _tool_fields(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's tool_calls (arguments decoded) or a tool result's tool_call_id."""
    if message["role"] == "tool":
        return {"tool_call_id": _check_str(message.get("tool_call_id"), f"{where}.tool_call_id")}
    if message.get("tool_calls") in (None, []):  # some clients send [] for no calls
        return {}
    return {"tool_calls": check_message_tool_calls(message["tool_calls"], f"{where}.tool_calls")}


def _check_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string; got {value!r}", param=where)
    return value


def _content_text(content: Any, where: str) -> str:
    """String content as is; text parts joined by newlines (vLLM's "string" format)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        return "\n".join(part["text"] for part in content)
    raise bad_request(
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
        raise bad_request("chat_template_kwargs must be an object", param="chat_template_kwargs")
    if kwargs.get("chat_template") is not None:
        raise bad_request(
            "chat_template_kwargs.chat_template is not allowed: the model's chat template is used",
            param="chat_template_kwargs.chat_template",
        )
    return kwargs


# ---- responses ---------------------------------------------------------------------------


class TokenLogprob(NamedTuple):
    """One token's logprob; `top` is None for the first echoed prompt token."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None
    text_offset: int


@dataclass
class Delta:
    """What one choice gained since the last response or chunk."""

    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ResponseShape:
    """Builds the response bodies and stream chunks of one request in OpenAI's shapes."""

    def __init__(self, parsed: OpenAIRequest, model: str):
        self.chat = parsed.chat
        self.with_logprobs = parsed.logprobs is not None
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model

    def response(self, deltas: list[Delta], usage: dict[str, Any]) -> dict[str, Any]:
        choices = [self._choice(i, delta, chunk=False) for i, delta in enumerate(deltas)]
        return self._head(chunk=False) | {"choices": choices, "usage": usage}

    def chunk(self, index: int, delta: Delta) -> dict[str, Any]:
        return self._head(chunk=True) | {"choices": [self._choice(index, delta, chunk=True)]}

    def role_chunk(self, index: int) -> dict[str, Any]:
        """The first chunk of a chat choice: the assistant's role, no content yet."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}  # fmt: skip
        return self._head(chunk=True) | {"choices": [choice]}

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
            if delta.tool_calls:
                choice["delta"]["tool_calls"] = [
                    c.to_openai(streamed=True) for c in delta.tool_calls
                ]
        else:
            choice["message"] = chat_message(delta)
        choice["logprobs"] = self._logprobs(delta.logprobs)
        choice["finish_reason"] = delta.finish_reason
        return choice

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries)


def chat_message(delta: Delta) -> dict[str, Any]:
    """A whole chat choice's message; with tool calls, empty content is null (as OpenAI)."""
    if not delta.tool_calls:
        return {"role": "assistant", "content": delta.text}
    calls = [call.to_openai() for call in delta.tool_calls]
    return {"role": "assistant", "content": delta.text or None, "tool_calls": calls}


def completion_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """/v1/completions logprobs; each top dict also holds the sampled token (as vLLM)."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else dict(e.top) | {e.token: e.logprob}
                         for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }  # fmt: skip


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """/v1/chat/completions logprobs: exactly `top_logprobs` alternatives per token."""

    def item(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            item(e.token, e.logprob) | {"top_logprobs": [item(t, v) for t, v in e.top or []]}
            for e in entries
        ]
    }


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
