"""The reasoning formats by `--reasoning-parser` name (SGLang's names), and the whole-text
split every dialect and the DSL call."""

from __future__ import annotations

from radixserve.reasoning.base import ReasoningSplit, StreamingReasoningParser
from radixserve.reasoning.harmony import GPT_OSS, HarmonyFormat
from radixserve.reasoning.think import DEEPSEEK_R1, QWEN3, ThinkFormat

ReasoningFormat = ThinkFormat | HarmonyFormat
REASONING_FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (DEEPSEEK_R1, QWEN3, GPT_OSS)}
ALIASES = {"qwen3-thinking": "deepseek-r1"}
"""SGLang's name for Qwen3 thinking models, whose template opens `<think>` as R1's does."""


def reasoning_parser_names() -> list[str]:
    """Every accepted `--reasoning-parser` value."""
    return [*REASONING_FORMATS, *ALIASES]


def reasoning_format(name: str) -> ReasoningFormat:
    """The format named `name`; ValueError naming the flag and the accepted names."""
    fmt = REASONING_FORMATS.get(ALIASES.get(name, name))
    if fmt is None:
        raise ValueError(
            f"--reasoning-parser {name!r} is not one of {', '.join(reasoning_parser_names())}"
        )
    return fmt


def reasoning_parser(
    name: str | ReasoningFormat, opened: bool | None = None, stream_reasoning: bool = True
) -> StreamingReasoningParser:
    """A streaming parser for one output. `opened`: whether the output starts inside the
    reasoning (None: the format's default; False: thinking was turned off in the prompt)."""
    fmt = reasoning_format(name) if isinstance(name, str) else name
    return fmt.parser(opened, stream_reasoning)


def split_reasoning(
    text: str, name: str | ReasoningFormat, opened: bool | None = None
) -> ReasoningSplit:
    """A whole output's reasoning and content."""
    return reasoning_parser(name, opened).feed(text, final=True)
