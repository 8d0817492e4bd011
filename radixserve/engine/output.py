"""Formats a request's state as SGLang's output dict: text, output_ids, meta_info."""

from __future__ import annotations

import time
from typing import Any

from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.request import Req
from radixserve.engine.stop import hold_back_partial_stop, trim_stop


def output_text(req: Req, tokenizer) -> str:
    """The output text so far. While running it never ends in half a character or in what
    may be the start of a stop string; once finished, the matched stop string is trimmed."""
    params = req.params
    if req.finished:
        text = tokenizer.decode(req.output_ids, skip_special_tokens=params.skip_special_tokens)
        return trim_stop(text, req.finish_reason, params.no_stop_trim)
    if req.detokenizer is None:
        req.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
    text = req.detokenizer.update(req.output_ids)
    return text if params.no_stop_trim else hold_back_partial_stop(text, params.stop_strs)


def format_output(req: Req, tokenizer, with_text: bool = False) -> dict[str, Any]:
    """SGLang's output dict with the cumulative output so far."""
    text = output_text(req, tokenizer)
    end = req.finish_time if req.finish_time is not None else time.perf_counter()
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish_reason,
        "e2e_latency": end - req.arrival_time,
    }
    if req.logprob is not None:
        meta |= _logprob_fields(req, tokenizer, with_text)
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}


def _logprob_fields(req: Req, tokenizer, with_text: bool) -> dict[str, Any]:
    def entry(value, token_id):
        return [value, token_id, tokenizer.decode([token_id]) if with_text else None]

    def tops(rows):
        return [None if row is None else [entry(v, t) for v, t in row] for row in rows]

    return {
        "input_token_logprobs": [entry(v, t) for v, t in req.input_logprobs],
        "output_token_logprobs": [entry(v, t) for v, t in req.output_logprobs],
        "input_top_logprobs": tops(req.input_top_logprobs),
        "output_top_logprobs": tops(req.output_top_logprobs),
    }
