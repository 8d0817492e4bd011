"""How `select` picks among scored choices: SGLang's three methods, same names and meta.

Each method sees, per choice, the logprob entries `[logprob, token_id, text]` of exactly the
choice's tokens (see select.py for where that span starts) and returns a ChoicesDecision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

Entries = list[list[Any]]  # [[logprob, token_id, text_or_None], ...] for one choice


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[Entries],
        output_token_logprobs: list[Entries],
        unconditional_token_logprobs: list[Entries] | None = None,
    ) -> ChoicesDecision: ...


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])


def _base_meta(normalized, input_lps, output_lps) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": normalized,
        "input_token_logprobs": input_lps,
        "output_token_logprobs": output_lps,
    }


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean logprob per token."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        best = choices[_argmax(normalized_prompt_logprobs)]
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoicesDecision(best, meta)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the choices whose next token is most likely, until one is left.
    Shorter choices are padded with their own mean logprob."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        matrix = _padded_matrix(input_token_logprobs)
        remaining = list(range(len(choices)))
        for column in range(len(matrix[0])):
            best = max(matrix[i][column] for i in remaining)
            remaining = [i for i in remaining if matrix[i][column] == best]
            if len(remaining) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[remaining[0]], meta)


def _padded_matrix(input_token_logprobs: list[Entries]) -> list[list[float]]:
    width = max(len(entries) for entries in input_token_logprobs)
    rows = []
    for entries in input_token_logprobs:
        values = [e[0] for e in entries]
        mean = sum(values) / len(values)
        rows.append(values + [mean] * (width - len(values)))
    return rows


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain the most from the context: mean(conditional -
    unconditional) logprob; the unconditional first token (no context at all) counts as 0."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        gains = [
            _mean_gain(cond, uncond)
            for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs)
        ]
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = gains
        return ChoicesDecision(choices[_argmax(gains)], meta)


def _mean_gain(cond: Entries, uncond: Entries) -> float:
    diffs = [c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond)]
    return sum(diffs) / len(diffs)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
