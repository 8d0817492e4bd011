"""Tool-call formats per model family: parsing a choice's output into content and calls
(streamed as OpenAI's argument fragments) and forcing one call in the family's format."""

from radixserve.server.tool_parsers.base import ParsedText, ToolCall, ToolCallDelta, ToolFormat
from radixserve.server.tool_parsers.parser import ToolCallParser
from radixserve.server.tool_parsers.registry import (
    DEFAULT_TOOL_PARSER,
    detect_tool_parser,
    resolve_tool_parser,
    tool_format,
    tool_parser_names,
)

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "ParsedText",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolFormat",
    "detect_tool_parser",
    "resolve_tool_parser",
    "tool_format",
    "tool_parser_names",
]
