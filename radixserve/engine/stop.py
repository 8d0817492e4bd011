"""Stop strings: matched on decoded text as tokens arrive; trimmed from the final text.
Stop regexes (SGLang's stop_regex): searched in the decoded tail, each search bounded in
time; a match is left in the text, as SGLang leaves it."""

from __future__ import annotations

import regex

from radixserve.engine.protocol import FinishReason
from radixserve.engine.request import Req

TAIL_SLACK_TOKENS = 8
STOP_REGEX_TAIL_TOKENS = 64
"""Output tokens a stop regex is searched in (a longer match is not seen)."""
STOP_REGEX_TIMEOUT_S = 0.02
"""Longest one stop-regex search may take; past it the request is aborted (a pattern that
backtracks without end must not stall the engine loop)."""


class StopRegexTimeout(Exception):
    """A stop regex's search ran past STOP_REGEX_TIMEOUT_S."""


def stop_regex_hit(req: Req, tokenizer) -> str | None:
    """The first stop regex with a match in the decoded tail of `req`'s output."""
    patterns = req.params.stop_regex_strs
    if not patterns or tokenizer is None:
        return None
    tail = tokenizer.decode(req.output_ids[-STOP_REGEX_TAIL_TOKENS:], skip_special_tokens=True)
    for pattern in patterns:
        try:
            if regex.search(pattern, tail, timeout=STOP_REGEX_TIMEOUT_S):
                return pattern
        except TimeoutError:
            raise StopRegexTimeout(pattern) from None
    return None


def stop_string_hit(req: Req, tokenizer) -> str | None:
    """The first stop string that the decoded tail of `req`'s output now contains."""
    stops = req.params.stop_strs
    if not stops or tokenizer is None:
        return None
    window = max(len(s) for s in stops) + TAIL_SLACK_TOKENS
    tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
    for stop in stops:
        if stop in tail:
            return stop
    return None


def hold_back_partial_stop(text: str, stops: list[str]) -> str:
    """Drops a tail of a running output that could be the start of a stop string, so that a
    stream never shows text that the final, trimmed output takes back."""
    keep = len(text)
    for stop in stops:
        for size in range(min(len(stop), len(text)), 0, -1):
            if text.endswith(stop[:size]):
                keep = min(keep, len(text) - size)
                break
    return text[:keep]


def trim_stop(
    text: str, finish_reason: FinishReason | None, no_stop_trim: bool, stops: list[str]
) -> str:
    """Cuts the text at the matched stop string (SGLang's default), unless no_stop_trim;
    `stops`: the request's stop strings (a stop regex's match is not cut)."""
    matched = getattr(finish_reason, "matched", None)
    if no_stop_trim or not isinstance(matched, str) or matched not in stops:
        return text
    cut = text.find(matched)
    return text if cut < 0 else text[:cut]
