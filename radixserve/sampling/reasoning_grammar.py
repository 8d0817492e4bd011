"""Grammar after reasoning: a matcher that lets a reasoning model think freely and applies the
request's constraint only once its reasoning has ended.

    output:  free reasoning ...  END  constrained by the grammar ...
             ^ any token          ^ the reasoning parser's end text (`</think>`, or gpt-oss's
                                    `<|channel|>final<|message|>`), seen in the decoded text

The end is found in the text (special tokens kept), so a marker written as one special token
or as several pieces ends the reasoning alike; the grammar begins at the next token. With a
budget (`max_reasoning_tokens`), reasoning that reaches it is ended by forcing the end text's
tokens, one per step. It stands in for an xgrammar matcher wherever the engine uses one
(masks, accepting, rollback of drafts and jumps); without an inner grammar, what follows the
reasoning is free.
"""

from __future__ import annotations

from typing import Any

import torch

TAIL_TOKENS = 8
"""Tokens decoded beyond the end text's own count when looking for it."""


class ReasoningMatcher:
    """A matcher that is free until `end_text` ends the reasoning, then `inner`'s (None:
    unconstrained); `budget`: the most reasoning tokens before the end text is forced. The
    engine drives it exactly like an xgrammar GrammarMatcher."""

    def __init__(self, inner: Any, tokenizer, end_text: str, budget: int | None = None):
        self.inner = inner
        self.tokenizer = tokenizer
        self.end_text = end_text
        self.end_ids = tokenizer.encode(end_text, add_special_tokens=False)
        self.budget = budget
        self.reasoning: list[int] = []  # the tokens accepted while reasoning
        self.num_forced = 0  # tokens of end_ids forced since the budget ran out
        self.num_inner = 0  # tokens the inner matcher accepted since the reasoning ended
        self.ended = False

    @property
    def forcing(self) -> bool:
        """Whether the budget ran out: the end text's tokens are forced."""
        return not self.ended and self.budget is not None and len(self.reasoning) >= self.budget

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        """Row `index` of xgrammar's int32 bitmask: what the next token may be."""
        if self.ended and self.inner is not None:
            self.inner.fill_next_token_bitmask(bitmask, index)
        elif self.forcing:
            token = self.end_ids[min(self.num_forced, len(self.end_ids) - 1)]
            bitmask[index].zero_()
            bit = 1 << (token % 32)
            bitmask[index, token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
        else:
            bitmask[index].fill_(-1)

    def accept_token(self, token: int) -> bool:
        if self.ended:
            accepted = True if self.inner is None else bool(self.inner.accept_token(token))
            self.num_inner += accepted
            return accepted
        if self.forcing:
            if token != self.end_ids[min(self.num_forced, len(self.end_ids) - 1)]:
                return False
            self.num_forced += 1
        self.reasoning.append(token)
        self.ended = self._end_seen()
        return True

    def is_terminated(self) -> bool:
        return self.ended and self.inner is not None and self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted, across the end of the reasoning too."""
        num_inner = min(num_tokens, self.num_inner)
        if num_inner and self.inner is not None:
            self.inner.rollback(num_inner)
        self.num_inner -= num_inner
        num_reasoning = num_tokens - num_inner
        if num_reasoning:
            self.ended = False
            del self.reasoning[len(self.reasoning) - num_reasoning :]
            over = len(self.reasoning) - (self.budget or 0)
            self.num_forced = max(0, over) if self.budget is not None else 0

    def find_jump_forward_string(self) -> str:
        """The text the grammar forces next: none while reasoning."""
        if self.ended and self.inner is not None:
            return self.inner.find_jump_forward_string()
        return ""

    def find_jump_forward_tokens(self) -> list[int]:
        if self.ended and self.inner is not None:
            return list(self.inner.find_jump_forward_tokens())
        return []

    def _end_seen(self) -> bool:
        if self.reasoning[-len(self.end_ids) :] == self.end_ids:
            return True
        tail = self.reasoning[-(len(self.end_ids) + TAIL_TOKENS) :]
        return self.end_text in self.tokenizer.decode(tail, skip_special_tokens=False)
