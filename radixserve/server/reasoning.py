"""Reasoning on the server's dialects: which requests think, how a constraint waits for the
reasoning to end, and the per-choice split of the output (radixserve/reasoning/).

With `--reasoning-parser`, a chat request thinks unless its template kwargs turn thinking
off (`enable_thinking: false`, or DeepSeek's `thinking: false`); then the output is read as
content unless it opens the reasoning itself. A thinking request with a constraint (regex,
json_schema, ebnf, a forced tool call) gets `reasoning_end`: the grammar applies after the
reasoning (sampling/reasoning_grammar.py). gpt-oss's markers are special tokens, kept in
the text unless the request says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.reasoning import ReasoningFormat, StreamingReasoningParser, reasoning_parser
from radixserve.sampling.params import GRAMMAR_KINDS


@dataclass(frozen=True)
class ReasoningOptions:
    """One request's reasoning: SGLang's `separate_reasoning` / `stream_reasoning`, whether
    it thinks, and a budget in tokens (Anthropic's `thinking.budget_tokens`)."""

    separate: bool = True
    stream: bool = True
    thinking: bool = True
    budget: int | None = None


def request_reasoning(
    body: dict[str, Any], template_kwargs: dict[str, Any], check_bool, check_count
) -> ReasoningOptions:
    """A chat-shaped body's reasoning options (chat completions, Responses):
    `separate_reasoning`, `stream_reasoning`, `max_reasoning_tokens`, thinking from the
    template kwargs; `check_bool` / `check_count` are the dialect's field checks."""
    return ReasoningOptions(
        separate=check_bool(body, "separate_reasoning", True),
        stream=check_bool(body, "stream_reasoning", True),
        thinking=thinking_of(template_kwargs),
        budget=check_count(body, "max_reasoning_tokens", limit=None),
    )


def thinking_of(template_kwargs: dict[str, Any]) -> bool:
    """Whether the template kwargs leave thinking on (Qwen3's and DeepSeek's switches)."""
    return template_kwargs.get("enable_thinking", True) is not False and (
        template_kwargs.get("thinking", True) is not False
    )


def reasoning_sampling(
    fmt: ReasoningFormat | None, options: ReasoningOptions, sampling: dict[str, Any]
) -> dict[str, Any]:
    """`sampling` with what the format needs: the end of reasoning for a constraint or a
    budget, special tokens kept for a format whose markers are special."""
    if fmt is None:
        return sampling
    sampling = dict(sampling)
    constrained = any(sampling.get(kind) is not None for kind in GRAMMAR_KINDS)
    if options.thinking and (constrained or options.budget is not None):
        sampling["reasoning_end"] = fmt.grammar_start
        if options.budget is not None:
            sampling["max_reasoning_tokens"] = options.budget
    if getattr(fmt, "special_markers", False):
        sampling.setdefault("skip_special_tokens", False)
    return sampling


def choice_reasoning_parser(
    fmt: ReasoningFormat | None, options: ReasoningOptions
) -> StreamingReasoningParser | None:
    """The parser of one choice's output; None when nothing is to be separated."""
    if fmt is None or not options.separate:
        return None
    return reasoning_parser(fmt, None if options.thinking else False, options.stream)
