"""Speculative decoding's acceptance rule: tokens emitted through verification follow the
target distribution (a chi-square test), and the test has the power to catch a biased rule."""

from __future__ import annotations

import pytest
import torch
from speculative_common import CHI2_999, chi_square

from radixserve.engine.request import Req
from radixserve.engine.speculative import Verifier
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import SamplingBatch, scale_and_filter

"""Chi-square quantiles at p = 0.999 by degrees of freedom."""
TARGET_ROWS = (  # a verify row and the bonus row after it, vocab 10
    [3.0, 2.5, 2.0, 1.6, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0],
    [0.3, -1.2, 2.2, 0.1, 1.4, -0.4, 1.9, 0.7, -2.0, 1.1],
)


def _verify_many(draft: int, num: int = 6000):
    """`num` requests (seeds 0..num-1) verify the one-token draft `draft` at temperature 1,
    top_p 0.9; returns their outcomes and the target distributions p of both rows."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)
    reqs = [Req(f"r{i}", [1, 2, 3], params, seed=i) for i in range(num)]
    rows = torch.tensor(TARGET_ROWS)
    results = Verifier(lambda req: []).verify(reqs, [[draft]] * num, rows.repeat(num, 1))
    batch = SamplingBatch.build([params] * 2, [0, 0], [[], [draft]], [[1, 2, 3]] * 2, [[], []], 10)
    return results, scale_and_filter(rows, batch, slice(None)).softmax(dim=-1)


@pytest.mark.parametrize("draft", [0, 3])  # the target's most likely token, an unlikely one
def test_tokens_emitted_through_verification_follow_the_target_distribution(draft):
    """Position 0 through a one-token draft, position 1 (the bonus token) after an accept:
    both follow p after temperature and top-p, whatever the draft."""
    results, target = _verify_many(draft)
    first = [r.tokens[0] for r in results]
    stat, dof = chi_square(first, target[0])
    assert stat < CHI2_999[dof], (stat, dof)
    bonus = [r.tokens[1] for r in results if r.num_accepted == 1]
    assert len(bonus) == first.count(draft) > 300
    stat, dof = chi_square(bonus, target[1])
    assert stat < CHI2_999[dof], (stat, dof)


@pytest.mark.parametrize("bias", ["always_accept", "no_removal"])
def test_a_biased_acceptance_rule_fails_the_distribution_check(monkeypatch, bias):
    """The check above has the power to catch a wrong rule: accepting every draft, or
    drawing the replacement from p without removing the rejected draft."""
    from radixserve.engine.speculative import verifier

    def biased(logits, batch, rows, drafts):
        accepted, replaced = original(logits, batch, rows, drafts)
        if bias == "always_accept":
            return accepted | (drafts >= 0), replaced
        draws = verifier.scale_and_filter(logits, batch, rows) + verifier.gumbel_from_uniform(
            verifier.uniform_noise(batch.seeds[rows], batch.steps[rows], batch.vocab_size)
        )
        return accepted, draws.argmax(dim=-1)

    original = verifier._accept_sampled
    monkeypatch.setattr(verifier, "_accept_sampled", biased)
    results, target = _verify_many(draft=1)
    stat, dof = chi_square([r.tokens[0] for r in results], target[0])
    assert stat > CHI2_999[dof]
