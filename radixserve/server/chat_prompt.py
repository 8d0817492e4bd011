"""The chat prompt for /v1/chat/completions: the conversation and any offered tools, as the
model's chat template writes them.

A chat template that renders `tools` (detected once per template by rendering a
probe tool) gets the tools and the tool turns of the history as they are, with each call's
arguments decoded to an object, as HF templates expect. Any other template gets plain text
in the Hermes/Qwen style:
- a system message (merged into the first one, if any) lists the tools, one JSON object per
  line inside <tools></tools>, and asks for calls in the `--tool-call-parser` format (qwen25:
  `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`);
- an assistant turn's `tool_calls` become calls in that format after its content;
- `tool` turns become a user turn of `<tool_response>\\n...\\n</tool_response>` blocks
  (consecutive results share one turn).

The model's calls are read back by tool_calls.py.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError

from radixserve.server.errors import BadRequest
from radixserve.server.tool_calls import NO_PARAMETERS
from radixserve.server.tool_parsers import DEFAULT_TOOL_PARSER, tool_format

TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions are \
listed below, one JSON object per line, inside <tools></tools> tags:
<tools>
{tools}
</tools>

{instruction}
Function results come back inside <tool_response></tool_response> tags."""

PROBE_NAME = "radixserve_probe_tool"
PROBE_TOOL = {"type": "function", "function": {"name": PROBE_NAME, "parameters": NO_PARAMETERS}}
_renders_tools: dict[str, bool] = {}  # chat template source -> whether it renders `tools`


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
    tool_parser: str = DEFAULT_TOOL_PARSER,
    param: str = "messages",
) -> str:
    """The conversation, with `tools` offered, as the chat template writes it; a template
    that cannot render tools gets them, and the tool turns, as plain text (calls written in
    `tool_parser`'s format). A conversation the template cannot render, or any when the
    model has no chat template, is a 400 naming `param`, the field it came from
    (Responses: `input`)."""
    if tokenizer.chat_template is None:
        message = f"{param} cannot be rendered: this model's tokenizer has no chat template"
        raise BadRequest(f"{message}; send a prompt to /v1/completions instead", param=param)
    kwargs = {"add_generation_prompt": True} | template_kwargs | {"tokenize": False}
    if (tools or _has_tool_turns(messages)) and not template_renders_tools(tokenizer):
        messages, tools = plain_tool_messages(messages, tools, tool_parser), None
    if tools:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except RecursionError as exc:  # transformers walks the template's data recursively
        raise BadRequest(f"{param} nests too deeply to be rendered", param=param) from exc
    except (TemplateError, TypeError, ValueError) as exc:
        raise BadRequest(f"{param} could not be rendered: {exc}", param=param) from exc


CONTINUE_FINAL_MESSAGE = {"add_generation_prompt": False, "continue_final_message": True}
"""Template kwargs that leave the last (assistant) turn open: the reply continues its text."""


def ends_with_assistant_text(messages: list[dict[str, Any]]) -> bool:
    """Whether the last turn is the assistant's text, which a reply may continue (a prefill:
    Anthropic's last assistant turn, OpenAI chat's `continue_final_message`)."""
    last = messages[-1] if messages else None
    return last is not None and last["role"] == "assistant" and "tool_calls" not in last


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template shows `tools` to the model (a probe tool's name appears)."""
    key = str(tokenizer.chat_template)
    if key not in _renders_tools:
        probe = [{"role": "user", "content": "hi"}]
        try:
            text = tokenizer.apply_chat_template(probe, tools=[PROBE_TOOL], tokenize=False)
        except (TemplateError, TypeError, ValueError):
            text = ""
        _renders_tools[key] = PROBE_NAME in text
    return _renders_tools[key]


def tools_system_prompt(tools: list[dict[str, Any]], tool_parser: str = DEFAULT_TOOL_PARSER) -> str:
    """The system text that lists the tools and how to call them (see module doc)."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_PROMPT.format(tools=lines, instruction=tool_format(tool_parser).instruction)


def plain_tool_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_parser: str = DEFAULT_TOOL_PARSER,
) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system prompt, calls in
    `tool_parser`'s format and results as tagged text."""
    converted: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message["role"] == "tool" and i and messages[i - 1]["role"] == "tool":
            joined = f"{converted[-1]['content']}\n{_result_block(message)}"
            converted[-1] = converted[-1] | {"content": joined}
        else:
            converted.append(_plain_message(message, tool_parser))
    if not tools:
        return converted
    return _with_system_text(converted, tools_system_prompt(tools, tool_parser))


def _plain_message(message: dict[str, Any], tool_parser: str) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": _result_block(message)}
    plain = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    write_call = tool_format(tool_parser).write_call
    calls = [write_call(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls", [])]  # fmt: skip
    plain["content"] = "\n".join(text for text in [message["content"], *calls] if text)
    return plain


def _result_block(message: dict[str, Any]) -> str:
    return f"<tool_response>\n{message['content']}\n</tool_response>"


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0] | {"content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
