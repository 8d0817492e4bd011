"""SGLang's output dict (text, output_ids, meta_info) for a RequestResult.

Streamed outputs (`LogprobCursor` given) carry the cumulative text and ids, as SGLang's do,
but only the logprobs new since the previous chunk; `output_token_logprobs_length` is the
cumulative count (== completion_tokens), as in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.client.result import RequestResult


@dataclass
class LogprobCursor:
    """How many input and output logprobs a stream has sent."""

    num_input: int = 0
    num_output: int = 0


def format_output(
    result: RequestResult,
    with_text: bool = False,
    cursor: LogprobCursor | None = None,
    prompt_ids: bool = False,
) -> dict[str, Any]:
    """SGLang's output dict with the cumulative output so far; `prompt_ids`: with SGLang's
    top-level `prompt_token_ids` (its `return_prompt_token_ids`)."""
    text = result.text()
    finish = result.finish_reason
    meta: dict[str, Any] = {
        "id": result.spec.rid,
        "prompt_tokens": result.prompt_len,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": result.cached_tokens,
        "num_retractions": result.num_retractions,
        "finish_reason": None if finish is None else finish.to_dict(),
        "e2e_latency": result.e2e_latency(),
    }
    if result.cached_tokens_host:  # SGLang's key, present when the host tier served some
        device = result.cached_tokens - result.cached_tokens_host
        meta["cached_tokens_details"] = {"device": device, "host": result.cached_tokens_host}
    if result.spec_counts is not None:
        meta |= result.spec_counts.meta_info(len(result.output_ids))
    if result.spec.params.grammar is not None:
        meta["jump_forward_tokens"] = result.jump_forward_tokens
    if result.spec.wants_logprobs:
        meta |= _logprob_fields(result, with_text, cursor or LogprobCursor())
        if cursor is not None:
            cursor.num_input = len(result.input_logprobs)
            cursor.num_output = len(result.output_logprobs)
    out = {"text": text, "output_ids": list(result.output_ids), "meta_info": meta}
    if prompt_ids:
        out["prompt_token_ids"] = list(result.spec.input_ids)
    return out


def _logprob_fields(result: RequestResult, with_text: bool, since: LogprobCursor) -> dict:
    decode = result.tokenizer.decode

    def entries(rows):
        return [[value, token, decode([token]) if with_text else None] for value, token in rows]

    def tops(rows):
        return [None if row is None else entries(row) for row in rows]

    i, o = since.num_input, since.num_output
    fields = {
        "input_token_logprobs": entries(result.input_logprobs[i:]),
        "output_token_logprobs": entries(result.output_logprobs[o:]),
        "input_top_logprobs": tops(result.input_top_logprobs[i:]),
        "output_top_logprobs": tops(result.output_top_logprobs[o:]),
        "output_token_logprobs_length": len(result.output_logprobs),
    }
    if result.spec.token_ids_logprob:  # SGLang's keys, present when the ids were asked for
        fields["input_token_ids_logprobs"] = tops(result.input_token_ids_logprobs[i:])
        fields["output_token_ids_logprobs"] = tops(result.output_token_ids_logprobs[o:])
    return fields
