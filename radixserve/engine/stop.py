"""Stop strings: matched on decoded text as tokens arrive; trimmed from the final text."""

from __future__ import annotations

from radixserve.engine.protocol import FinishReason
from radixserve.engine.request import Req

TAIL_SLACK_TOKENS = 8


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


def trim_stop(text: str, finish_reason: FinishReason | None, no_stop_trim: bool) -> str:
    """Cuts the text at the matched stop string (SGLang's default), unless no_stop_trim."""
    matched = getattr(finish_reason, "matched", None)
    if no_stop_trim or not isinstance(matched, str):
        return text
    cut = text.find(matched)
    return text if cut < 0 else text[:cut]
