"""The tool-call formats by name: SGLang's names, vLLM's as aliases, and the format a chat
template implies when `--tool-call-parser` is not given."""

from __future__ import annotations

from radixserve.server.tool_parsers.base import ToolFormat
from radixserve.server.tool_parsers.deepseekv3 import DEEPSEEKV3
from radixserve.server.tool_parsers.llama3 import LLAMA3
from radixserve.server.tool_parsers.mistral import MISTRAL
from radixserve.server.tool_parsers.pythonic import PYTHONIC
from radixserve.server.tool_parsers.qwen3_coder import QWEN3_CODER
from radixserve.server.tool_parsers.qwen25 import QWEN25

TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (QWEN25, LLAMA3, MISTRAL, PYTHONIC, DEEPSEEKV3, QWEN3_CODER)
}
ALIASES = {"hermes": "qwen25", "llama3_json": "llama3", "deepseek_v3": "deepseekv3"}
DEFAULT_TOOL_PARSER = "qwen25"
TEMPLATE_MARKERS = {
    "deepseekv3": "<｜tool▁calls▁begin｜>",
    "mistral": "[TOOL_CALLS]",
    "qwen3_coder": "<function=",
    "llama3": "<|python_tag|>",
    "pythonic": "<|python_start|>",
    "qwen25": "<tool_call>",
}
"""Text in a chat template that names its family's format."""
IMPLIED = {"qwen3_coder": "qwen25"}
"""A family whose template also writes another's marker (Qwen3-Coder's wraps `<tool_call>`)."""


def tool_parser_names() -> list[str]:
    """Every accepted `--tool-call-parser` value."""
    return [*TOOL_FORMATS, *ALIASES]


def tool_format(name: str) -> ToolFormat:
    """The format named `name` (or an alias); ValueError naming the accepted ones."""
    fmt = TOOL_FORMATS.get(ALIASES.get(name, name))
    if fmt is None:
        raise ValueError(
            f"--tool-call-parser {name!r} is not one of {', '.join(tool_parser_names())}"
        )
    return fmt


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The one format the chat template's text names; None when none or several do."""
    if not chat_template:
        return None
    found = {name for name, marker in TEMPLATE_MARKERS.items() if marker in chat_template}
    found -= {IMPLIED[name] for name in found if name in IMPLIED}
    return found.pop() if len(found) == 1 else None


def resolve_tool_parser(name: str | None, chat_template: str | None) -> str:
    """The format's canonical name: the one given, else the template's, else the default."""
    if name is not None:
        return tool_format(name).name
    return detect_tool_parser(chat_template) or DEFAULT_TOOL_PARSER
