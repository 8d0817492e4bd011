"""Anthropic's Messages API request bodies (/v1/messages, /v1/messages/count_tokens), checked
and mapped onto what chat completions already uses: chat messages (anthropic_messages.py),
OpenAI-shaped tools and a `ToolChoice` (tool_calls.py), SamplingParams' fields.

Field by field:
- `max_tokens` is required (as Anthropic), an integer >= 1 -> max_new_tokens.
- `temperature` in [0, 1] (Anthropic's range), `top_p`, `top_k`, `stop_sequences` -> stop.
- `tools`: `{"name", "description", "input_schema", "cache_control", "type": "custom"}`;
  Anthropic's server tools (bash, web search, ...) are a 400.
- `tool_choice`: auto | any (= "required") | tool + name (= a named function) | none;
  `disable_parallel_tool_use: true` keeps the first call only.
- `cache_control` on the request marks its last block (as Anthropic's top-level one does).
- `metadata` (`user_id`) is accepted and not used; `service_tier` "auto" / "standard_only"
  is accepted as the no-op it is here.
- `thinking`: `{"type": "disabled"}` turns thinking off (`enable_thinking: false` for the
  template, unless chat_template_kwargs says otherwise); `{"type": "enabled",
  "budget_tokens": n}` (n < max_tokens; Anthropic's minimum of 1024 is not enforced) turns
  it on and ends longer reasoning at n tokens; needs `--reasoning-parser` (checked by the
  route). Reasoning comes back as `thinking` blocks (server/reasoning.py).
- `chat_template_kwargs` as on chat completions (a `chat_template` of its own is a 400), and
  the extras `ignore_eos`, `seed` (SamplingParams' `sampling_seed`) and the output
  constraints `regex` / `json_schema` / `ebnf` (one at most, none with a forced tool call).
A field this server does not know is a 400 naming it, unless null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.client.request_builder import REQUEST_OPTIONS
from radixserve.server.anthropic_messages import (
    Conversation,
    check_cache_control,
    convert_conversation,
)
from radixserve.server.chat_messages import check_template_kwargs
from radixserve.server.chat_prompt import CONTINUE_FINAL_MESSAGE, ends_with_assistant_text
from radixserve.server.errors import BadRequest
from radixserve.server.reasoning import ReasoningOptions, thinking_of
from radixserve.server.request_fields import check_fields
from radixserve.server.response_format import (
    CONSTRAINT_FIELDS,
    Constraint,
    forced_call_constraint,
)
from radixserve.server.tenants import check_salt
from radixserve.server.tool_calls import NAME_PATTERN, ToolChoice, check_tools
from radixserve.server.tool_parsers import DEFAULT_TOOL_PARSER

MAX_TEMPERATURE = 1.0
"""Anthropic's upper bound on temperature."""
EXTRA_SAMPLING_FIELDS = {"ignore_eos": "ignore_eos", "seed": "sampling_seed"}
"""radixserve's extras (as on chat completions) -> SamplingParams' names."""
COUNT_FIELDS = {
    "model", "messages", "system", "tools", "tool_choice", "cache_control", "chat_template_kwargs",
    "thinking",
}  # fmt: skip
MESSAGES_FIELDS = COUNT_FIELDS | {
    "max_tokens",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "cache_salt",
    *EXTRA_SAMPLING_FIELDS,
    *CONSTRAINT_FIELDS,
    *REQUEST_OPTIONS,
}
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "service_tier": ("auto", "standard_only"),
}
"""Fields accepted only at values that change nothing here."""
TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}
PARALLEL_KEYS = {"type", "disable_parallel_tool_use"}
TOOL_CHOICE_KEYS = {
    "auto": PARALLEL_KEYS,
    "any": PARALLEL_KEYS,
    "tool": PARALLEL_KEYS | {"name"},
    "none": {"type"},
}
TOOL_CHOICE_MODES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


@dataclass
class MessagesRequest:
    """A checked Messages request, before rendering: the chat-completions view of it."""

    model: str
    messages: list[dict[str, Any]]
    sampling: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = ToolChoice("none")
    single_tool_use: bool = False  # disable_parallel_tool_use
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    breakpoint_messages: list[dict[str, Any]] | None = None  # up to the last cache_control
    reasoning: ReasoningOptions = ReasoningOptions()
    thinking_given: bool = False  # the body asked for thinking (enabled or disabled)
    cache_salt: str | None = None  # the namespace: cache_salt or the X-Cache-Salt header
    options: dict[str, Any] = field(default_factory=dict)  # the REQUEST_OPTIONS given

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: none when tool_choice is "none"."""
        return self.tools if self.tool_choice.mode != "none" else None


def parse_messages_request(
    body: Any,
    count_only: bool = False,
    tool_parser: str = DEFAULT_TOOL_PARSER,
    salt_header: str | None = None,
) -> MessagesRequest:
    """Checks a /v1/messages body (count_only: a /v1/messages/count_tokens one); a forced
    call is constrained to `tool_parser`'s format; `salt_header`: X-Cache-Salt."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    check_fields(body, COUNT_FIELDS if count_only else MESSAGES_FIELDS, NO_OP_VALUES)
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest(f"model: a string is required; got {model!r}", param="model")
    conversation = Conversation()
    tools = _check_tools(body.get("tools"), conversation)
    convert_conversation(body.get("system"), body.get("messages"), conversation)
    check_cache_control(body.get("cache_control"), "cache_control")
    if body.get("cache_control") is not None:
        conversation.mark()  # a top-level marker: on the last block, i.e. the whole prompt
    choice, single = check_tool_choice(body.get("tool_choice"), tools)
    thinking, budget = check_thinking(body.get("thinking"), body.get("max_tokens"))
    kwargs = _template_kwargs(body, conversation)
    if thinking is not None:
        kwargs = {"enable_thinking": thinking} | kwargs
    parsed = MessagesRequest(
        cache_salt=check_salt(body.get("cache_salt"), salt_header),
        options={name: body[name] for name in REQUEST_OPTIONS if name in body},
        model=model,
        messages=conversation.messages,
        tools=tools,
        tool_choice=choice,
        single_tool_use=single,
        template_kwargs=kwargs,
        breakpoint_messages=conversation.breakpoint,
        reasoning=ReasoningOptions(thinking=thinking_of(kwargs), budget=budget),
        thinking_given=thinking is not None,
    )
    if not count_only:
        parsed.stream = _check_bool(body, "stream")
        parsed.sampling = sampling_dict(body, tools, choice, tool_parser)
        check_metadata(body.get("metadata"))
    return parsed


def _check_bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false; got {value!r}", param=name)
    return bool(value)


def _template_kwargs(body: dict, conversation: Conversation) -> dict[str, Any]:
    """The template's extra variables; a last assistant turn is continued, not closed."""
    kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    if ends_with_assistant_text(conversation.messages):
        kwargs = kwargs | CONTINUE_FINAL_MESSAGE
    return kwargs


def check_thinking(value: Any, max_tokens: Any) -> tuple[bool | None, int | None]:
    """`thinking` -> (thinking on, budget in tokens); (None, None) when absent."""
    if value is None:
        return None, None
    if value == {"type": "disabled"}:
        return False, None
    budget = value.get("budget_tokens") if isinstance(value, dict) else None
    shaped = isinstance(value, dict) and value.get("type") == "enabled" and len(value) == 2
    if not shaped or not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise BadRequest(
            "thinking must be {'type': 'disabled'} or {'type': 'enabled', 'budget_tokens': "
            f"int >= 1}}; got {value!r}"[:200],
            param="thinking",
        )
    if isinstance(max_tokens, int) and budget >= max_tokens:
        raise BadRequest(
            f"thinking.budget_tokens must be less than max_tokens ({max_tokens}); got {budget}",
            param="thinking.budget_tokens",
        )
    return True, budget


def check_metadata(value: Any) -> None:
    """`metadata`: `{"user_id": str}` at most (an opaque id, not used here)."""
    if value is None:
        return
    user_id = value.get("user_id") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or set(value) - {"user_id"}
        or not (user_id is None or isinstance(user_id, str))
    ):
        raise BadRequest(f"metadata must be {{'user_id': str}}; got {value!r}"[:160], "metadata")


# ---- sampling ----------------------------------------------------------------------------


def sampling_dict(
    body: dict,
    tools: list[dict[str, Any]],
    choice: ToolChoice,
    tool_parser: str = DEFAULT_TOOL_PARSER,
) -> dict[str, Any]:
    """SamplingParams' fields; a forced tool call adds its JSON schema."""
    sampling = {"max_new_tokens": check_max_tokens(body.get("max_tokens"))}
    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
            raise BadRequest(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}]; got {temperature!r}",
                param="temperature",
            )
        sampling["temperature"] = temperature
    names = {"top_p": "top_p", "top_k": "top_k"} | EXTRA_SAMPLING_FIELDS
    sampling |= {names[k]: body[k] for k in names if body.get(k) is not None}
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise BadRequest(
                f"stop_sequences must be a list of non-empty strings; got {stops!r}"[:160],
                param="stop_sequences",
            )
        sampling["stop"] = stops
    given = [Constraint(k, k, body[k]) for k in CONSTRAINT_FIELDS if body.get(k) is not None]
    given.append(forced_call_constraint(tools, choice, tool_parser))
    given = [constraint for constraint in given if constraint is not None]
    if len(given) > 1:
        first, second = given[0].param, given[1].param
        raise BadRequest(
            f"{second} cannot be combined with {first}: one constraint at most", param=second
        )
    sampling |= {c.kind: c.spec for c in given}
    return sampling


def check_max_tokens(value: Any) -> int:
    if value is None:
        raise BadRequest("max_tokens: Field required", param="max_tokens")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1; got {value!r}", param="max_tokens")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- tools -------------------------------------------------------------------------------


def _check_tools(value: Any, conversation: Conversation) -> list[dict[str, Any]]:
    """Anthropic's custom tools as OpenAI function tools (checked by tool_calls.py)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequest(f"tools must be a list of tools; got {value!r}"[:160], param="tools")
    converted = [_function_tool(tool, f"tools[{i}]", conversation) for i, tool in enumerate(value)]
    return check_tools(converted)


def _function_tool(tool: Any, where: str, conversation: Conversation) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise BadRequest(
            f"{where} must be a custom tool {{'name', 'description', 'input_schema'}}; "
            f"{kind!r} tools are not supported by this server"[:200],
            param=where,
        )
    check_fields(tool, TOOL_KEYS, {}, where, of="a tool")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise BadRequest(
            f"{where}.input_schema must be a JSON schema object; got {schema!r}"[:160],
            f"{where}.input_schema",
        )
    if not isinstance(tool.get("name"), str) or not NAME_PATTERN.match(tool["name"]):
        name = tool.get("name")
        message = f"{where}.name must match {NAME_PATTERN.pattern}; got {name!r}"
        raise BadRequest(message[:160], f"{where}.name")
    check_cache_control(tool.get("cache_control"), f"{where}.cache_control")
    if tool.get("cache_control") is not None:
        conversation.mark()  # tools come before system and messages in Anthropic's prefix
    function = {
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": schema,
    }
    return {"type": "function", "function": function}


def check_tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[ToolChoice, bool]:
    """`tool_choice` -> (ToolChoice, disable_parallel_tool_use); auto by default with tools."""
    if value is None:
        return ToolChoice("auto" if tools else "none"), False
    kind = value.get("type") if isinstance(value, dict) else None
    keys = TOOL_CHOICE_KEYS.get(kind) if isinstance(kind, str) else None
    name = value.get("name") if kind == "tool" else None
    single = value.get("disable_parallel_tool_use") if isinstance(value, dict) else None
    if (
        keys is None
        or set(value) - keys
        or (kind == "tool") != isinstance(name, str)
        or not (single is None or isinstance(single, bool))
    ):
        raise BadRequest(
            "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': "
            f"str}}, with an optional disable_parallel_tool_use: bool; got {value!r}"[:240],
            param="tool_choice",
        )
    choice = ToolChoice(TOOL_CHOICE_MODES[kind], name)
    names = [tool["function"]["name"] for tool in tools]
    if choice.forced and not tools:
        raise BadRequest(f"tool_choice {kind!r} requires tools", param="tool_choice")
    if name is not None and name not in names:
        raise BadRequest(
            f"tool_choice names tool {name!r}, which is not among the tools {names}",
            param="tool_choice",
        )
    return (choice if tools else ToolChoice("none")), bool(single)
