"""sampling/logprobs.token_ranks: a token's rank among a row's logits (vLLM's `rank` of
prompt_logprobs), ties sharing the better rank."""

from __future__ import annotations

import torch

from radixserve.sampling.logprobs import token_ranks


def test_ranks_count_the_larger_logits_and_ties_share_the_better_rank():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 2.0]])
    assert token_ranks(logits, torch.tensor([1, 0])).tolist() == [1, 1]
    assert token_ranks(logits, torch.tensor([2, 3])).tolist() == [1, 2]
    assert token_ranks(logits, torch.tensor([3, 2])).tolist() == [4, 4]
    rows = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(6) * 7
    expected = [
        (row.argsort(descending=True) == i).nonzero().item() + 1 for row, i in zip(rows, ids)
    ]
    assert token_ranks(rows, ids).tolist() == expected
