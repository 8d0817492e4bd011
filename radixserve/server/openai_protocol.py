"""OpenAI's request bodies: /v1/completions and /v1/chat/completions in, validated.

Field names follow OpenAI, plus vLLM's and SGLang's extra sampling fields (`regex`,
`json_schema`, `ebnf` constrain the output, like `response_format`; one constraint at most:
see response_format.py).
A field this server does not know is rejected when it carries a value (null is fine), so
nothing is silently accepted and ignored, except `user` (as in vLLM).
Chat messages: chat_messages.py; tools: tool_calls.py; responses: openai_response.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.client.request_builder import REQUEST_OPTIONS
from radixserve.engine.request import MAX_LOGPROBS
from radixserve.sampling.params import is_token_ids
from radixserve.server.chat_messages import check_messages, check_template_kwargs
from radixserve.server.chat_prompt import CONTINUE_FINAL_MESSAGE, ends_with_assistant_text
from radixserve.server.errors import BadRequest
from radixserve.server.reasoning import ReasoningOptions, request_reasoning
from radixserve.server.request_fields import check_fields
from radixserve.server.response_format import CONSTRAINT_FIELDS, output_constraint
from radixserve.server.tenants import check_salt
from radixserve.server.tool_calls import ToolChoice, check_tool_choice, check_tools
from radixserve.server.tool_parsers import DEFAULT_TOOL_PARSER

MAX_TEMPERATURE = 2.0
"""OpenAI's upper bound on temperature, which vLLM's OpenAI server keeps; SGLang's has none."""


# Fields copied into SamplingParams under the same name.
SAMPLING_FIELDS = (
    "temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "top_k",
    "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "no_stop_trim", "speculative", "logit_bias", "allowed_token_ids", "bad_words",
)  # fmt: skip
COMMON_FIELDS = {
    *SAMPLING_FIELDS, "model", "max_tokens", "seed", "min_tokens", "logprobs", "stream",
    "stream_options", "cache_salt", "user", "response_format", *CONSTRAINT_FIELDS,
    *REQUEST_OPTIONS, "include_stop_str_in_output", "structured_outputs",
    "return_tokens_as_token_ids", "return_token_ids", "prompt_logprobs", "rid", "request_id",
    "add_special_tokens",
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
    "parallel_tool_calls", "tools", "tool_choice", "separate_reasoning", "stream_reasoning",
    "max_reasoning_tokens", "continue_final_message", "add_generation_prompt",
}  # fmt: skip
TOKENIZE_FIELDS = {
    "model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
    "chat_template_kwargs",
}  # fmt: skip

# Fields this server does not implement: accepted only at their no-op value. Besides OpenAI's,
# the SGLang extensions that sglang-router writes into every body it forwards, at its defaults
# (it re-serializes requests; on completions, separating reasoning is a no-op).
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,), "return_hidden_states": (False,),
    # vLLM's extras at their defaults, which its clients send as they are
    "spaces_between_special_tokens": (True,), "use_beam_search": (False,),
    "length_penalty": (1, 1.0), "echo": (False,), "mm_processor_kwargs": ({},),
}  # fmt: skip
"""Fields accepted only at values that change nothing here."""


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
    suffix: str = ""  # completions: the text after the gap (fill-in-the-middle)
    messages: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens "token_id:N"
    token_ids: bool = False  # vLLM's return_token_ids: prompt and output token ids returned
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and rank + top k
    add_special_tokens: bool | None = None  # vLLM's; None: chat False, completions True
    echo: bool = False
    cache_salt: Any = None
    options: dict[str, Any] = field(default_factory=dict)  # the REQUEST_OPTIONS given
    max_tokens_name: str = "max_tokens"
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = ToolChoice("none")
    single_call: bool = False  # parallel_tool_calls false: at most one call per choice
    reasoning: ReasoningOptions = ReasoningOptions()

    @property
    def n(self) -> int:
        return self.sampling.get("n", 1)

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: none when tool_choice is "none"."""
        return self.tools if self.tool_choice.mode != "none" else None

    @property
    def core_names(self) -> dict[str, str]:
        """SamplingParams' names in core validation messages, as this body calls them."""
        return {
            "max_new_tokens": self.max_tokens_name,
            "min_new_tokens": "min_tokens",
            "sampling_seed": "seed",
            "input_ids": "prompt token ids",
        }


def parse_request(
    body: Any, chat: bool, tool_parser: str = DEFAULT_TOOL_PARSER, salt_header: str | None = None
) -> OpenAIRequest:
    """Validates a /v1/completions (chat=False) or /v1/chat/completions body; a forced tool
    call is constrained to `tool_parser`'s format; `salt_header`: X-Cache-Salt."""
    body = check_object(body)
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, NO_OP_VALUES)
    stream = check_bool(body, "stream")
    check_temperature(body)
    include_usage, continuous_usage = check_stream_options(body.get("stream_options"), stream)
    parsed = OpenAIRequest(
        chat=chat,
        model=check_model(body),
        sampling=sampling_dict(body),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        tokens_as_ids=check_bool(body, "return_tokens_as_token_ids"),
        token_ids=check_bool(body, "return_token_ids"),
        prompt_logprobs=check_top_count(body, "prompt_logprobs"),
        add_special_tokens=check_bool(body, "add_special_tokens", None),
        cache_salt=check_salt(body.get("cache_salt"), salt_header),
        options={name: body[name] for name in REQUEST_OPTIONS if name in body},
    )
    rid = _request_id(body)
    if rid is not None:
        parsed.options["rid"] = rid
    if stream and parsed.prompt_logprobs is not None:  # as vLLM
        raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    if chat:
        _parse_chat(body, parsed)
    else:
        _parse_completion(body, parsed)
    constraint = output_constraint(body, parsed.tools, parsed.tool_choice, tool_parser)
    if constraint is not None:
        parsed.sampling[constraint.kind] = constraint.spec
    return parsed


def _request_id(body: dict) -> Any:
    """SGLang's `rid` or vLLM's `request_id`: the request's id, as /abort_request names it
    (n > 1: each choice's is the id + "-i"); given both, they must agree."""
    given = {name: body[name] for name in ("rid", "request_id") if body.get(name) is not None}
    if len(given) == 2 and given["rid"] != given["request_id"]:
        raise bad_request("rid and request_id name the same thing: give one", param="request_id")
    return next(iter(given.values()), None)


def _parse_completion(body: dict, parsed: OpenAIRequest) -> None:
    parsed.prompt = check_prompt(body.get("prompt"))
    parsed.logprobs = check_top_count(body, "logprobs")
    parsed.echo = check_bool(body, "echo")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad_request(f"suffix must be a string; got {suffix!r}"[:200], param="suffix")
    if suffix:
        if not all(isinstance(p, str) for p in parsed.prompt):
            raise bad_request("suffix needs text prompts, not token ids", param="suffix")
        if parsed.echo:
            raise bad_request("suffix and echo do not go together", param="suffix")
        parsed.suffix = suffix


def _parse_chat(body: dict, parsed: OpenAIRequest) -> None:
    parsed.messages = check_messages(body.get("messages"))
    parsed.template_kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    if body.get("add_generation_prompt") is not None:  # vLLM's, beside the template kwargs
        kwargs = {"add_generation_prompt": check_bool(body, "add_generation_prompt")}
        parsed.template_kwargs = parsed.template_kwargs | kwargs
    if check_bool(body, "continue_final_message") and ends_with_assistant_text(parsed.messages):
        parsed.template_kwargs = parsed.template_kwargs | CONTINUE_FINAL_MESSAGE  # SGLang's rule
    parsed.logprobs = check_chat_logprobs(body)
    if body.get("max_completion_tokens") is not None:
        parsed.sampling["max_new_tokens"] = body["max_completion_tokens"]
        parsed.max_tokens_name = "max_completion_tokens"
    parsed.tools = check_tools(body.get("tools"))
    parsed.tool_choice = check_tool_choice(body.get("tool_choice"), parsed.tools)
    parsed.single_call = not check_bool(body, "parallel_tool_calls", True)
    parsed.reasoning = request_reasoning(body, parsed.template_kwargs, check_bool, check_top_count)


def sampling_dict(body: dict) -> dict[str, Any]:
    """OpenAI's sampling fields under SamplingParams' names; absent and null fields left out."""
    params = {name: body.get(name) for name in SAMPLING_FIELDS}
    params["max_new_tokens"] = body.get("max_tokens")
    params["min_new_tokens"] = body.get("min_tokens")
    params["sampling_seed"] = body.get("seed")
    include_stop = body.get("include_stop_str_in_output")  # vLLM's name for no_stop_trim
    if include_stop is not None:
        if not isinstance(include_stop, bool) or params["no_stop_trim"] not in (None, include_stop):
            message = "include_stop_str_in_output must be a boolean (agreeing with no_stop_trim)"
            raise bad_request(message, param="include_stop_str_in_output")
        params["no_stop_trim"] = include_stop
    return {name: value for name, value in params.items() if value is not None}


# ---- field checks ------------------------------------------------------------------------


def check_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", param="body")
    return body


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


def check_top_count(body: dict, name: str, limit: int | None = MAX_LOGPROBS) -> int | None:
    """A count in [0, limit] (a logprobs count by default; None: no upper bound), or None
    when absent."""
    value = body.get(name)
    if value is None:
        return None
    top = 2**31 if limit is None else limit
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
        allowed = f"in [0, {limit}]" if limit is not None else ">= 0"
        raise bad_request(f"{name} must be an integer {allowed}; got {value!r}", param=name)
    return value


def check_chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (a boolean) with `top_logprobs` (0-20): the alternatives shown per
    token, or None without logprobs (Ollama's bodies take the same pair)."""
    top = check_top_count(body, "top_logprobs")
    if check_bool(body, "logprobs"):
        return top or 0
    if top:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    return None


def check_stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
    """`stream_options`: (include_usage, continuous_usage_stats, which counts only with
    include_usage, as in vLLM); the options are only allowed on a stream."""
    if options is None:
        return False, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    names = ("include_usage", "continuous_usage_stats")
    shaped = isinstance(options, dict) and not set(options) - set(names)
    if not shaped or not all(isinstance(options.get(n), (bool, type(None))) for n in names):
        raise bad_request(
            "stream_options must be {'include_usage': bool, 'continuous_usage_stats': bool}; "
            f"got {options!r}"[:240],
            "stream_options",
        )
    include = bool(options.get("include_usage"))
    return include, include and bool(options.get("continuous_usage_stats"))


def check_prompt(prompt: Any) -> list[str] | list[list[int]]:
    """A string, strings, token ids or lists of token ids, as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if is_token_ids(prompt):
            return [prompt]
        if all(p and is_token_ids(p) for p in prompt):
            return prompt
    raise bad_request(
        "prompt must be a string, a non-empty list of strings, a list of token ids or a list "
        f"of such lists; got {str(prompt)[:80]}",
        param="prompt",
    )
