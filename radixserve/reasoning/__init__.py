"""Reasoning formats per model family (`--reasoning-parser`): an output split into its
reasoning and its content, whole (`split_reasoning`) or as it streams (`reasoning_parser`:
`feed(delta) -> ReasoningSplit(reasoning, content)`). Shared by the server's dialects and
the DSL; imports nothing else of radixserve."""

from radixserve.reasoning.base import ReasoningSplit, StreamingReasoningParser
from radixserve.reasoning.registry import (
    REASONING_FORMATS,
    ReasoningFormat,
    reasoning_format,
    reasoning_parser,
    reasoning_parser_names,
    split_reasoning,
)

__all__ = [
    "REASONING_FORMATS",
    "ReasoningFormat",
    "ReasoningSplit",
    "StreamingReasoningParser",
    "reasoning_format",
    "reasoning_parser",
    "reasoning_parser_names",
    "split_reasoning",
]
