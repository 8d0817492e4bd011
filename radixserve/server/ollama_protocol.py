"""Ollama's /api/chat and /api/generate request bodies, checked and mapped onto what chat
completions already uses: OpenAI-shaped messages and tools (chat_messages.py, tool_calls.py),
SamplingParams' fields, one output constraint (response_format.py).

Field by field (both endpoints unless said):
- `model` is required: the served name, optionally with Ollama's default tag `:latest`, or a
  LoRA adapter's name.
- `stream` defaults to true, as Ollama's.
- `options`: `num_predict` -> max_new_tokens (-1 and -2, and absent: what the context
  leaves), `temperature`, `top_k`, `top_p`, `min_p`, `seed`, `stop`, `repeat_penalty`,
  `presence_penalty`, `frequency_penalty`. Ollama's load-time options (`num_ctx`,
  `num_thread`, `num_gpu`, ...) are accepted and change nothing: the server was started with
  its own. Samplers this server does not run (`mirostat`, `tfs_z`, `typical_p`, ...) are a
  400 naming the option unless at their neutral value.
- `format`: "json" (any JSON object) or a JSON schema object.
- `think`: true / false (or Ollama's "low" | "medium" | "high", as true); needs a server
  started with `--reasoning-parser` to be true (checked by the route).
- `logprobs` and `top_logprobs` (0-20), `keep_alive` (accepted: the model stays loaded).
- chat: `messages` (roles system, user, assistant, tool; `tool_calls` with object arguments,
  `tool_name` on results; an assistant's `thinking` is the turn's reasoning, which the chat
  template keeps or drops; `images` are a 400: the models here read text only), `tools`
  (OpenAI's form).
- generate: `prompt`, `system`, `raw` (the prompt as is, no template), `context` (token ids a
  previous response returned, put before the prompt), `suffix` (the code after the gap: the
  prompt becomes the model's fill-in-the-middle one, completion_template.py; not with
  `system` or `raw`); `template` (a request's own template) and `images` are a 400.
- radixserve's own: `cache_salt` (or the X-Cache-Salt header) and the request options
  (`priority`, `session_id`, `retention`, ...), as on every API here.
A field this server does not know is a 400 naming it, unless null.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixserve.client.request_builder import REQUEST_OPTIONS
from radixserve.sampling.params import is_int
from radixserve.server.chat_messages import check_messages
from radixserve.server.errors import BadRequest
from radixserve.server.openai_protocol import check_bool, check_chat_logprobs
from radixserve.server.reasoning import ReasoningOptions
from radixserve.server.request_fields import check_fields
from radixserve.server.response_format import check_response_format
from radixserve.server.tenants import check_salt
from radixserve.server.tool_calls import check_tools

DEFAULT_TAG = ":latest"
COMMON_FIELDS = {
    "model",
    "stream",
    "options",
    "format",
    "think",
    "keep_alive",
    "logprobs",
    "top_logprobs",
    "cache_salt",
    *REQUEST_OPTIONS,
}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools"}
GENERATE_FIELDS = COMMON_FIELDS | {"prompt", "system", "raw", "context", "suffix"}
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {"suffix": ("",), "template": ("",), "images": ([],)}
"""Fields accepted only at values that change nothing here."""
SAMPLING_OPTIONS = {
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "seed": ("sampling_seed", int),
    "repeat_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
}
"""Ollama's runtime options -> (SamplingParams' name, the JSON type they take)."""
LOAD_OPTIONS = {
    "numa",
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "embedding_only",
    "num_thread",
    "num_keep",
}
"""Options that size or place the model when Ollama loads it: this server was started with
its own, so they change nothing."""
NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {
    "mirostat": (0,),
    "tfs_z": (1, 1.0),
    "typical_p": (1, 1.0),
    "penalize_newline": (True, False),
    "mirostat_tau": (5, 5.0),
    "mirostat_eta": (0.1,),
}
"""Samplers this server does not run, accepted at values where they do nothing (mirostat's
tau / eta do nothing while mirostat is 0; penalize_newline only with a repeat penalty)."""
OPTION_NAMES = {"num_predict", "stop", "repeat_last_n", *SAMPLING_OPTIONS, *LOAD_OPTIONS}
MESSAGE_KEYS = {"role", "content", "images", "thinking", "tool_calls", "tool_name", "tool_call_id"}
THINK_LEVELS = ("low", "medium", "high")


@dataclass
class OllamaRequest:
    """A checked /api/chat or /api/generate body, before rendering."""

    model: str
    chat: bool
    stream: bool = True
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat: OpenAI's shape
    prompt: str = ""  # generate
    system: str | None = None  # generate
    raw: bool = False  # generate: the prompt as is
    suffix: str = ""  # generate: the text after the gap (fill-in-the-middle)
    context: list[int] = field(default_factory=list)  # generate: ids before the prompt
    tools: list[dict[str, Any]] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    think: bool | None = None  # None: as the template's default
    logprobs: int | None = None  # top alternatives per token when logprobs are asked
    cache_salt: str | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the REQUEST_OPTIONS given

    @property
    def loads_only(self) -> bool:
        """Nothing to generate from: Ollama's way to load a model (done_reason "load")."""
        if self.chat:
            return not self.messages
        return not self.prompt and not self.context and not self.suffix

    @property
    def reasoning(self) -> ReasoningOptions:
        return ReasoningOptions(thinking=self.think is not False)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.think is None else {"enable_thinking": self.think}


def parse_ollama_request(body: Any, chat: bool, salt_header: str | None = None) -> OllamaRequest:
    """Checks an /api/chat (chat) or /api/generate body; `salt_header`: X-Cache-Salt."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    check_fields(body, CHAT_FIELDS if chat else GENERATE_FIELDS, NO_OP_VALUES)
    model = required_model(body.get("model"))
    parsed = OllamaRequest(
        model=model,  # answers name it as asked; the route looks it up without DEFAULT_TAG
        chat=chat,
        stream=check_bool(body, "stream", True),
        think=_think(body.get("think")),
        cache_salt=check_salt(body.get("cache_salt"), salt_header),
        options={name: body[name] for name in REQUEST_OPTIONS if name in body},
    )
    if chat:
        parsed.messages = [_message(m, f"messages[{i}]") for i, m in enumerate(_list(body))]
        if parsed.messages:
            parsed.messages = check_messages(parsed.messages)
        parsed.tools = check_tools(body.get("tools"))
    else:
        parsed.prompt = _str(body, "prompt")
        parsed.system = _str(body, "system") if body.get("system") is not None else None
        parsed.raw = check_bool(body, "raw", False)
        parsed.context = _context(body.get("context"))
        parsed.suffix = _str(body, "suffix")
        if parsed.suffix and (parsed.raw or parsed.system is not None):
            name = "raw" if parsed.raw else "system"
            raise BadRequest(f"{name} does not go with suffix (a fill-in-the-middle prompt)",
                             param=name)  # fmt: skip
    parsed.sampling = sampling_dict(body.get("options"))
    constraint = _format(body.get("format"))
    if constraint is not None:
        parsed.sampling["json_schema"] = constraint
    parsed.logprobs = check_chat_logprobs(body)
    return parsed


def required_model(model: Any) -> str:
    """An Ollama body's `model`: required, a non-empty name (a tag included)."""
    if not isinstance(model, str) or not model:
        raise BadRequest(f"model is required: a model name; got {model!r}"[:200], param="model")
    return model


def _list(body: dict) -> list:
    messages = body.get("messages")
    if messages is None:
        return []
    if not isinstance(messages, list):
        raise BadRequest(
            f"messages must be a list of messages; got {messages!r}"[:160], param="messages"
        )
    return messages


def _message(message: Any, where: str) -> dict[str, Any]:
    """An Ollama message as chat completions' (checked again by check_messages)."""
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object; got {message!r}"[:160], param=where)
    check_fields(message, MESSAGE_KEYS, {"images": ([],), "thinking": ("",)}, where, "a message")
    if message.get("images") not in (None, []):
        raise BadRequest(
            f"{where}.images: this server's models read text only", param=f"{where}.images"
        )
    converted = {"role": message.get("role"), "content": message.get("content") or ""}
    if message.get("thinking") and message.get("role") == "assistant":  # the turn's reasoning
        converted["reasoning_content"] = message["thinking"]
    if message.get("role") == "tool":
        name = message.get("tool_name")
        call_id = message.get("tool_call_id") or name or ""
        if not isinstance(call_id, str) or not (name is None or isinstance(name, str)):
            raise BadRequest(f"{where}.tool_name must be a string", param=f"{where}.tool_name")
        converted |= {"tool_call_id": call_id} | ({"name": name} if name else {})
    calls = message.get("tool_calls")
    if calls not in (None, []):
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise BadRequest(
                f"{where}.tool_calls must be a list, on an assistant message",
                param=f"{where}.tool_calls",
            )
        converted["tool_calls"] = [
            _call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)
        ]
    return converted


def _call(call: Any, where: str) -> dict[str, Any]:
    """Ollama's {"function": {"name", "arguments": {...}}} as OpenAI's call (checked later)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise BadRequest(
            f"{where} must be {{'function': {{'name': str, 'arguments': object}}}}", param=where
        )
    call_id = call.get("id") or ""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": function.get("name"), "arguments": function.get("arguments")},
    }


def _str(body: dict, name: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string; got {value!r}"[:160], param=name)
    return value


def _think(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if value in THINK_LEVELS:
        return True
    raise BadRequest(
        f"think must be true, false or one of {THINK_LEVELS}; got {value!r}"[:160], param="think"
    )


def _context(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise BadRequest("context must be a list of token ids", param="context")
    return value


def _format(value: Any) -> dict[str, Any] | None:
    """`format`: "json" (any object), a JSON schema object, or ""/absent (free text)."""
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "object"}
    if isinstance(value, dict):
        format_ = {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
        try:
            return check_response_format(format_).spec
        except BadRequest as exc:
            raise BadRequest(f"format: {exc}"[:300], param="format") from None
    raise BadRequest(
        f'format must be "json" or a JSON schema object; got {value!r}'[:160], param="format"
    )


# ---- options -----------------------------------------------------------------------------


def sampling_dict(options: Any) -> dict[str, Any]:
    """Ollama's `options` -> SamplingParams' fields (absent and null ones left out)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise BadRequest(f"options must be an object; got {options!r}"[:160], param="options")
    check_fields(options, OPTION_NAMES, NEUTRAL_OPTIONS, "options", "Ollama's options")
    sampling: dict[str, Any] = {}
    for name, (target, kind) in SAMPLING_OPTIONS.items():
        if options.get(name) is not None:
            sampling[target] = _number(options[name], f"options.{name}", kind)
    num_predict = options.get("num_predict")
    if num_predict is not None:
        num_predict = _number(num_predict, "options.num_predict", int)
        if num_predict >= 0:  # -1: until it stops, -2: until the context is full
            sampling["max_new_tokens"] = num_predict
        elif num_predict not in (-1, -2):
            raise BadRequest(
                f"options.num_predict must be >= -2; got {num_predict}", param="options.num_predict"
            )
    stop = options.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest(
                f"options.stop must be a list of non-empty strings; got {stop!r}"[:160],
                param="options.stop",
            )
        sampling["stop"] = stop
    last_n = options.get("repeat_last_n")
    if last_n is not None and sampling.get("repetition_penalty", 1.0) != 1.0:
        raise BadRequest(
            "options.repeat_last_n is not supported by this server: its repeat_penalty is not "
            "limited to the last n tokens; leave repeat_last_n out",
            param="options.repeat_last_n",
        )
    return sampling


def _number(value: Any, where: str, kind: type) -> int | float:
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        noun = "an integer" if kind is int else "a number"
        raise BadRequest(f"{where} must be {noun}; got {json.dumps(value)[:80]}", param=where)
    return value
