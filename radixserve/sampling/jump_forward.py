"""Jump-forward for constrained output (SGLang's compressed FSM): where the grammar admits
exactly one continuation, its text becomes output tokens without sampling.

The forced text is what xgrammar's `find_jump_forward_tokens` covers: the forced string
without a last token that a longer token could still extend (a jump ending in `{` would
leave the model to write `}` after it, where it writes `{}` as one token). It is tokenized
together with the request's newest token (SGLang's `jump_and_retokenize`), so that a
boundary such as `{"` + `name` reads as the tokenizer would write it. Retokenization
reaches back over that one token only: it was sampled in this very step, so no caller has
seen it and no K/V holds it; nothing streamed is ever taken back. A retokenization is used
only if it decodes to exactly the old text plus the forced text and the grammar accepts
every token; otherwise the tokenizer's tokens of the forced text are appended after the
newest token, and failing that xgrammar's.

    output:  ... a b t            t: sampled now (not streamed, no K/V)
    jump:    ... a b [c1 c2 ... cF]   tokenize(text(t) + forced); or ... a b t [c1 ... cF]

With speculative decoding, a draft stops before the first token that a jump would follow
(`num_before_jump`): the target samples that token and the jump comes after it, as without
speculation, so greedy output is the same either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CONTEXT_TOKENS = 4
"""Output tokens before the newest one decoded with it, so that its text (leading spaces,
characters split over tokens) is read in context."""


@dataclass(frozen=True)
class Jump:
    """Replace the last `num_replaced` output tokens (0 or 1) with `tokens`."""

    num_replaced: int
    tokens: list[int]

    @property
    def num_forced(self) -> int:
        """Output tokens gained without sampling."""
        return len(self.tokens) - self.num_replaced


def find_jump(
    matcher: Any, tokenizer, output_ids: list[int], can_replace: bool, room: int
) -> Jump | None:
    """The jump after `output_ids` (the matcher has accepted them), at most `room` tokens
    longer than the output; None if the grammar forces nothing. `can_replace`: the newest
    token may be retokenized (it is neither streamed nor computed). The matcher ends where
    it started."""
    if room <= 0 or not matcher.find_jump_forward_string():
        return None
    tokens = list(matcher.find_jump_forward_tokens())
    forced = tokenizer.decode(tokens)
    if not tokens or forced.endswith("\ufffd"):
        return None
    context = output_ids[-CONTEXT_TOKENS - 1 :]
    for jump in _candidates(tokenizer, context, forced, tokens, can_replace):
        if jump is None or jump.num_forced <= 0:
            continue
        jump = Jump(jump.num_replaced, jump.tokens[: room + jump.num_replaced])
        if _grammar_accepts(matcher, output_ids[len(output_ids) - jump.num_replaced :], jump):
            return jump
    return None


def num_before_jump(
    matcher: Any, tokenizer, output_ids: list[int], draft: list[int], room: int
) -> int:
    """How many of `draft`'s tokens (valid for the grammar) come before the first one that
    a jump would follow, were it sampled; the matcher ends where it started."""
    num = 0
    for token in draft:
        matcher.accept_token(token)
        seq = output_ids + draft[: num + 1]
        if find_jump(matcher, tokenizer, seq, can_replace=True, room=room - num - 1):
            break
        num += 1
    matcher.rollback(min(num + 1, len(draft)))
    return num


def _candidates(
    tokenizer, context: list[int], forced: str, tokens: list[int], can_replace: bool
) -> Iterator[Jump | None]:
    """The ways to tokenize the jump, best first (None: that way does not read the same);
    the last, xgrammar's own tokens of the forced text, always reads the same."""
    text = tokenizer.decode(context) + forced
    if can_replace and context:
        yield _retokenized(tokenizer, context, forced, text)
    yield _appended(tokenizer, context, forced, text)
    yield Jump(0, tokens)


def _retokenized(tokenizer, context: list[int], forced: str, text: str) -> Jump | None:
    """The newest token and the forced text tokenized together, if that reads the same."""
    head = context[:-1]
    base = tokenizer.decode(head)
    newest = tokenizer.decode(context)
    if not newest.startswith(base) or newest.endswith("\ufffd"):
        return None
    tokens = tokenizer.encode(newest[len(base) :] + forced, add_special_tokens=False)
    return Jump(1, tokens) if tokenizer.decode(head + tokens) == text else None


def _appended(tokenizer, context: list[int], forced: str, text: str) -> Jump | None:
    """The forced text's own tokens after the newest token, if that reads the same."""
    tokens = tokenizer.encode(forced, add_special_tokens=False)
    return Jump(0, tokens) if tokenizer.decode(context + tokens) == text else None


def _grammar_accepts(matcher: Any, replaced: list[int], jump: Jump) -> bool:
    """Whether the grammar takes the jump's tokens in place of `replaced`, none of them
    ending it (a stop token spelled out in the forced text); the matcher ends where it
    started."""
    if replaced:
        matcher.rollback(len(replaced))
    num_accepted = 0
    for token in jump.tokens:
        if not matcher.accept_token(token):
            break
        num_accepted += 1
        if matcher.is_terminated():
            break
    ok = num_accepted == len(jump.tokens) and not matcher.is_terminated()
    if num_accepted:
        matcher.rollback(num_accepted)
    for token in replaced:
        matcher.accept_token(token)
    return ok
