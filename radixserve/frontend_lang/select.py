"""`select`: score every choice in one batched, prefill-only request over the cached prefix.

Which tokens belong to a choice? Tokenize the prefix P and each P + choice; the choice's
tokens are those after their longest common token prefix. Usually that is all of P, but a
BPE merge across the boundary (P ends in " ", the choice starts with "yes", and " yes" is one
token) changes P's last token; the scored span then starts at that token, so every choice is
scored on the text it adds, never on a token that P alone would not have produced (SGLang
#608, #2873). The engine reports no logprob for the first position it returns (SGLang's
layout), so the request starts one position before the earliest span (#1257).

    prefix ids:  [ t0 t1 ... t(k-1) | tk  ]        tk = " "
    with choice: [ t0 t1 ... t(k-1) | " yes" ]     scored span starts at k
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.frontend_lang.backends import Backend
from radixserve.frontend_lang.choices import ChoicesDecision, ChoicesSamplingMethod, Entries
from radixserve.token_ids import common_prefix_len


@dataclass(frozen=True)
class ScoredChoice:
    """One choice's full token ids and where its scored span starts."""

    input_ids: list[int]
    span_start: int


def plan_choices(backend: Backend, prefix: str, choices: list[str]) -> list[ScoredChoice]:
    """Tokenizes prefix + each choice and finds each choice's span (see module docstring)."""
    prefix_ids = backend.encode(prefix)
    plans = []
    for choice in choices:
        ids = backend.encode(prefix + choice)
        start = max(common_prefix_len(prefix_ids, ids), 1)  # position 0 has no logprob
        if start >= len(ids):
            raise ValueError(f"select choice {choice!r} adds no token after the prefix")
        plans.append(ScoredChoice(ids, start))
    return plans


def select_choice(
    backend: Backend, prefix: str, choices: list[str], method: ChoicesSamplingMethod
) -> ChoicesDecision:
    """Commits the prefix, scores all choices in one batch, and lets `method` decide."""
    check_choices(choices)
    plans = plan_choices(backend, prefix, choices)
    if prefix:  # every choice's ids start with these; prefill them once, shared by all
        backend.cache_prefix(input_ids=plans[0].input_ids[: min(p.span_start for p in plans)])
    spans = score_spans(backend, plans)
    unconditional = None
    if method.requires_unconditional_logprobs:
        unconditional = unconditional_spans(backend, spans)
    return method(
        choices=choices,
        normalized_prompt_logprobs=[_mean(span) for span in spans],
        input_token_logprobs=spans,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=unconditional,
    )


def score_spans(backend: Backend, plans: list[ScoredChoice]) -> list[Entries]:
    """Each choice's span entries [logprob, token_id, text], from one batched request."""
    start_len = min(p.span_start for p in plans) - 1
    outputs = backend.score([p.input_ids for p in plans], start_len)
    spans = []
    for plan, out in zip(plans, outputs):
        entries = out["meta_info"]["input_token_logprobs"]  # entry j = position start_len + j
        spans.append(entries[plan.span_start - start_len :])
    return spans


def unconditional_spans(backend: Backend, spans: list[Entries]) -> list[Entries]:
    """The same tokens scored without any context (the first one has no logprob: None)."""
    outputs = backend.score([[e[1] for e in span] for span in spans], 0)
    return [out["meta_info"]["input_token_logprobs"] for out in outputs]


def check_choices(choices: list[str]) -> None:
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError(f"select needs a non-empty list of choices; got choices={choices!r}")
    bad = [c for c in choices if not isinstance(c, str) or not c]
    if bad:
        raise ValueError(f"select choices must be non-empty strings; got {bad[0]!r} in choices")


def _mean(span: Entries) -> float:
    return sum(e[0] for e in span) / len(span)
