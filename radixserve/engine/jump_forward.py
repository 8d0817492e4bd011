"""JumpForward: the scheduler's side of jump-forward for constrained output.

After a constrained request's newest token is committed, the text its grammar forces next
(sampling/jump_forward.py) is appended to its output unsampled, each token checked as a
sampled one is (grammar, stop strings, max_new_tokens); the next steps compute those tokens
as an extend, so the request neither samples nor speculates until they are in the cache.
With speculation, drafts stop before a token that a jump would follow.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.engine.logprobs import fill_unscored, replace_last_output
from radixserve.engine.request import Req
from radixserve.engine.stats import EngineStats
from radixserve.sampling.jump_forward import find_jump, num_before_jump


class JumpForward:
    def __init__(
        self, enabled: bool, tokenizer, check_finish: Callable[[Req, int], None], stats: EngineStats
    ):
        self.enabled = enabled and tokenizer is not None
        self.tokenizer = tokenizer
        self.check_finish = check_finish
        self.stats = stats

    def applies(self, req: Req) -> bool:
        return self.enabled and req.grammar is not None and not req.finished

    def after_token(self, req: Req, last_logits: torch.Tensor | None) -> None:
        """Appends what the request's grammar forces next. `last_logits`: the row that
        sampled its newest token in this step (the jump may retokenize that token, which
        no caller has seen); None: nothing was sampled (a request about to be admitted)."""
        if not self.applies(req):
            return
        room = req.params.max_new_tokens - len(req.output_ids)
        can_replace = last_logits is not None
        jump = find_jump(req.grammar, self.tokenizer, req.output_ids, can_replace, room)
        if jump is None:
            return
        if jump.num_replaced:
            req.grammar.rollback(jump.num_replaced)
            del req.output_ids[-jump.num_replaced :]
            if req.logprob is not None:
                replace_last_output(req, jump.num_replaced, last_logits, jump.tokens[0])
        num_forced = self._append(req, jump.tokens) - jump.num_replaced
        req.jump_forward_tokens += max(num_forced, 0)
        self.stats.jump_forward_tokens += max(num_forced, 0)
        if req.finished and req.logprob is not None:
            fill_unscored(req)

    def cut_draft(self, req: Req, draft: list[int]) -> list[int]:
        """The draft up to the first token a jump would follow: the target samples that
        one, then jumps, as without speculation (so greedy output is the same)."""
        if not draft or not self.applies(req):
            return draft
        room = req.params.max_new_tokens - len(req.output_ids)
        return draft[: num_before_jump(req.grammar, self.tokenizer, req.output_ids, draft, room)]

    def _append(self, req: Req, tokens: list[int]) -> int:
        """Appends `tokens` up to the first that ends the request; how many it appended."""
        for num, token in enumerate(tokens, 1):
            req.output_ids.append(token)
            self.check_finish(req, token)
            if req.finished:
                return num
        return len(tokens)
