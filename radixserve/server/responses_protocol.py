"""OpenAI's Responses API request bodies (POST /v1/responses), checked and mapped onto what
chat completions already uses: input items (responses_items.py), OpenAI-shaped tools and a
`ToolChoice` (tool_calls.py), one output constraint (response_format.py), SamplingParams'
fields.

Field by field:
- `input`: a string or items; `instructions`: a system message before the conversation
  (not carried over by `previous_response_id`, as OpenAI);
- `max_output_tokens` (>= 1; absent: up to the context, as chat completions), `temperature`
  in [0, 2], `top_p`, and the extras `ignore_eos`, `seed`, `top_k`, `min_p`,
  `repetition_penalty`, `regex`, `chat_template_kwargs`, `cache_salt` and REQUEST_OPTIONS;
- `tools`: flat function tools `{"type": "function", "name", "description", "parameters",
  "strict"}` (hosted tools are a 400); `tool_choice`: auto | none | required |
  `{"type": "function", "name"}`; `parallel_tool_calls: false` keeps the first call only;
- `text.format`: text | json_object | json_schema `{"name", "schema", "strict",
  "description"}` (flat, as Responses has it), through the grammar path; a forced call
  takes precedence (its output is the call), and with tool_choice auto a schema leaves the
  model no way to call;
- `store` (default true), `previous_response_id`, `metadata` (at most 16 string pairs, as
  OpenAI), `stream`;
- `reasoning.effort` (with `--reasoning-parser`): "none" turns thinking off, any other
  effort reaches the chat template as `reasoning_effort` (gpt-oss's template reads it);
  `reasoning.summary` is accepted and not produced; `separate_reasoning`,
  `stream_reasoning`, `max_reasoning_tokens` as on chat completions (server/reasoning.py).
`include` takes "reasoning.encrypted_content" (reasoning items then carry it: responses_items.py
seals and opens it); `truncation` "auto" drops the oldest items of the conversation until the
prompt fits (responses_api.render_prompt). Accepted at their no-op values only: `background`
false, `service_tier` "auto" / "default", `prompt_cache_retention` "in_memory", `top_logprobs`
0, `stream_options` without settings; `user` and `prompt_cache_key` are taken
and not used (the radix cache caches every prefix). Any other field is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.client.request_builder import REQUEST_OPTIONS
from radixserve.server.chat_messages import check_template_kwargs
from radixserve.server.errors import BadRequest
from radixserve.server.openai_protocol import (
    check_bool,
    check_model,
    check_temperature,
    check_top_count,
)
from radixserve.server.reasoning import ReasoningOptions, request_reasoning
from radixserve.server.request_fields import check_fields
from radixserve.server.response_format import (
    Constraint,
    check_response_format,
    forced_call_constraint,
)
from radixserve.server.responses_items import check_input
from radixserve.server.responses_options import (
    check_conversation,
    check_include,
    check_metadata,
    check_reasoning,
    optional_str,
)
from radixserve.server.tenants import check_salt
from radixserve.server.tool_calls import ToolChoice, check_tools, checked_tool_choice
from radixserve.server.tool_parsers import DEFAULT_TOOL_PARSER

EXTRA_SAMPLING_FIELDS = {
    "ignore_eos": "ignore_eos",
    "seed": "sampling_seed",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "regex": "regex",
}
"""radixserve's extras (as on chat completions) -> SamplingParams' names; `regex` is the
output's one constraint (with text.format text and no forced call)."""
RESPONSES_FIELDS = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "store",
    "previous_response_id",
    "conversation",
    "metadata",
    "stream",
    "user",
    "prompt_cache_key",
    "chat_template_kwargs",
    "cache_salt",
    "include",
    "truncation",
    "reasoning",
    "separate_reasoning",
    "stream_reasoning",
    "max_reasoning_tokens",
    *EXTRA_SAMPLING_FIELDS,
    *REQUEST_OPTIONS,
}
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "service_tier": ("auto", "default"),
    "prompt_cache_retention": ("in_memory",),
    "top_logprobs": (0,),
    "stream_options": ({}, {"include_obfuscation": False}),
}
"""Fields accepted only at values that change nothing here."""
TRUNCATIONS = ("disabled", "auto")
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
TEXT_KEYS = {"format", "verbosity"}
FORMAT_TYPES = ("text", "json_object", "json_schema")
FORMAT_SHAPE = (
    "{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'name': str, "
    "'schema': object, 'strict': bool}"
)
TOOL_CHOICE_SHAPE = "'auto', 'none', 'required' or {'type': 'function', 'name': str}"


@dataclass
class ResponsesRequest:
    """A checked Responses request, before the chain is resolved and the prompt rendered."""

    model: str | None
    input_items: list[dict[str, Any]]
    instructions: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)  # chat-completions shape
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | None = None  # a /v1/conversations id: its items first, this turn's after
    metadata: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    cache_salt: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # the REQUEST_OPTIONS given
    reasoning: ReasoningOptions = ReasoningOptions()
    effort: str | None = None  # reasoning.effort, echoed
    sealed_reasoning: bool = False  # include reasoning.encrypted_content
    truncation: str = "disabled"  # "auto": the oldest items dropped until the prompt fits

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: none when tool_choice is "none"."""
        return self.tools if self.tool_choice.mode != "none" else None

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response object repeats them."""
        choice = self.tool_choice
        tool_choice: Any = choice.mode
        if choice.mode == "function":
            tool_choice = {"type": "function", "name": choice.name}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.sampling.get("max_new_tokens"),
            "metadata": self.metadata,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "conversation": {"id": self.conversation} if self.conversation else None,
            "temperature": self.sampling.get("temperature", 1.0),
            "top_p": self.sampling.get("top_p", 1.0),
            "tool_choice": tool_choice,
            "tools": [{"type": "function"} | tool["function"] for tool in self.tools],
            "text": {"format": self.text_format},
            "reasoning": {"effort": self.effort, "summary": None},
            "store": self.store,
            "truncation": self.truncation,
        }


def parse_responses_request(
    body: Any, tool_parser: str = DEFAULT_TOOL_PARSER, salt_header: str | None = None
) -> ResponsesRequest:
    """Checks a /v1/responses body; a forced call is constrained to `tool_parser`'s format.
    `salt_header`: the request's X-Cache-Salt, which names the namespace as `cache_salt` does."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    check_fields(body, RESPONSES_FIELDS, NO_OP_VALUES)
    check_temperature(body)
    tools = _check_tools(body.get("tools"))
    choice = check_tool_choice(body.get("tool_choice"), tools)
    parsed = ResponsesRequest(
        model=check_model(body),
        input_items=check_input(body.get("input")),
        instructions=optional_str(body, "instructions"),
        sampling=sampling_dict(body),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=check_bool(body, "parallel_tool_calls", True),
        store=check_bool(body, "store", True),
        previous_response_id=optional_str(body, "previous_response_id"),
        metadata=check_metadata(body.get("metadata")),
        stream=check_bool(body, "stream"),
        cache_salt=check_salt(body.get("cache_salt"), salt_header),
        template_kwargs=check_template_kwargs(body.get("chat_template_kwargs")),
        options={name: body[name] for name in REQUEST_OPTIONS if name in body},
    )
    for name in ("user", "prompt_cache_key"):
        optional_str(body, name)
    parsed.conversation = check_conversation(body.get("conversation"))
    if parsed.conversation and parsed.previous_response_id:
        raise BadRequest("conversation cannot be combined with previous_response_id: give one",
                         param="conversation")  # fmt: skip
    parsed.sealed_reasoning = check_include(body.get("include"))
    parsed.truncation = body.get("truncation") or "disabled"
    if parsed.truncation not in TRUNCATIONS:
        raise BadRequest(
            f"truncation must be one of {TRUNCATIONS}; got {body.get('truncation')!r}"[:200],
            param="truncation",
        )
    parsed.effort = check_reasoning(body.get("reasoning"), parsed.template_kwargs)
    parsed.reasoning = request_reasoning(body, parsed.template_kwargs, check_bool, check_top_count)
    parsed.text_format = _check_text(body.get("text"), parsed, tool_parser)
    return parsed


# ---- sampling ----------------------------------------------------------------------------


def sampling_dict(body: dict) -> dict[str, Any]:
    """SamplingParams' fields; absent and null fields left out."""
    sampling: dict[str, Any] = {}
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise BadRequest(
                f"max_output_tokens must be an integer >= 1; got {limit!r}", "max_output_tokens"
            )
        sampling["max_new_tokens"] = limit
    names = {"temperature": "temperature", "top_p": "top_p"} | EXTRA_SAMPLING_FIELDS
    return sampling | {names[k]: body[k] for k in names if body.get(k) is not None}


# ---- tools and text.format ---------------------------------------------------------------


def _check_tools(value: Any) -> list[dict[str, Any]]:
    """Flat function tools, as chat completions' tools (checked by tool_calls.py)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest(f"tools must be a list of function tools; got {value!r}"[:160], "tools")
    converted = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequest(
                f"{where} must be a function tool {{'type': 'function', 'name', 'parameters'}}; "
                f"{kind!r} tools are not supported by this server"[:200],
                param=where,
            )
        check_fields(tool, TOOL_KEYS, {}, where, of="a tool")
        function = {k: tool[k] for k in TOOL_KEYS - {"type"} if tool.get(k) is not None}
        converted.append({"type": "function", "function": function})
    try:
        checked = check_tools(converted)
    except BadRequest as exc:  # its messages name chat completions' nesting
        raise BadRequest(str(exc).replace(".function.", "."), param="tools") from exc
    for tool, original in zip(checked, converted):
        if "strict" in original["function"]:
            tool["function"]["strict"] = original["function"]["strict"]
    return checked


def check_tool_choice(value: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """auto by default with tools, none without; a named function must be among the tools."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("auto", "none", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and set(value) == {"type", "name"} and value["type"] == "function":
        choice = ToolChoice("function", value["name"])
    else:
        raise BadRequest(
            f"tool_choice must be {TOOL_CHOICE_SHAPE}; got {value!r}"[:200], param="tool_choice"
        )
    return checked_tool_choice(choice, value, tools)


def _check_text(value: Any, parsed: ResponsesRequest, tool_parser: str) -> dict[str, Any]:
    """`text.format` -> the request's output constraint; returns the format as the response
    echoes it. A forced call (tool_choice required or named) wins: the output is that call,
    and the format governs message text, of which there is none."""
    if value is not None and (not isinstance(value, dict) or set(value) - TEXT_KEYS):
        raise BadRequest(f"text must be {{'format': {{...}}}}; got {value!r}"[:160], "text")
    if value is not None and value.get("verbosity") not in (None, "medium"):
        raise BadRequest("text.verbosity is not supported by this server", "text.verbosity")
    fmt = (value or {}).get("format") or {"type": "text"}
    constraint = forced_call_constraint(parsed.tools, parsed.tool_choice, tool_parser)
    text_constraint = _format_constraint(fmt)
    constraint = constraint or text_constraint
    if constraint is not None and "regex" in parsed.sampling:
        raise BadRequest(
            "regex is a constraint of its own: give it with text.format text and no forced "
            "tool call",
            param="regex",
        )
    if constraint is not None:
        parsed.sampling[constraint.kind] = constraint.spec
    return fmt


def _format_constraint(fmt: Any) -> Constraint | None:
    """text.format's constraint (checked as chat completions' response_format)."""
    if not isinstance(fmt, dict) or fmt.get("type") not in FORMAT_TYPES:
        raise BadRequest(
            f"text.format must be {FORMAT_SHAPE}; got {fmt!r}"[:240], param="text.format"
        )
    try:
        return check_response_format(_as_response_format(fmt))
    except BadRequest as exc:
        message = str(exc).replace("response_format", "text.format")
        if "unusable" not in message:
            message = f"text.format must be {FORMAT_SHAPE}; got {fmt!r}"[:240]
        raise BadRequest(message, param="text.format") from exc


def _as_response_format(fmt: Any) -> Any:
    """Responses' flat json_schema format in chat completions' nesting (others as they are)."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt
