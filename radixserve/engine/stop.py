"""Stop strings: matched on decoded text as tokens arrive; trimmed from the final text."""

from __future__ import annotations

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


def trim_stop(text: str, finish_reason: dict | None, no_stop_trim: bool) -> str:
    """Cuts the text at the matched stop string (SGLang's default), unless no_stop_trim."""
    matched = (finish_reason or {}).get("matched")
    if no_stop_trim or not isinstance(matched, str):
        return text
    cut = text.find(matched)
    return text if cut < 0 else text[:cut]
