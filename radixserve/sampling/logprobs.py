"""Log-probabilities of chosen tokens and of the top-k tokens, from raw logits."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TopLogprobs(NamedTuple):
    values: torch.Tensor  # [N, k] float32, descending per row
    ids: torch.Tensor  # [N, k] int64


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[i, token_ids[i]] for logits [N, V], token_ids [N]; returns [N]."""
    logits = logits.float()
    chosen = logits.gather(1, token_ids.long()[:, None]).squeeze(1)
    return chosen - logits.logsumexp(dim=-1)


def token_ranks(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each row's rank of token_ids[i] among logits [N, V] (1: the largest; ties share the
    better rank, as vLLM counts them); returns [N]."""
    logits = logits.float()
    chosen = logits.gather(1, token_ids.long()[:, None])
    return (logits > chosen).sum(dim=-1) + 1


def picked_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[:, token_ids] for logits [N, V] and the same ids [K] in every
    row; returns [N, K]."""
    logits = logits.float()
    return logits[:, token_ids.long()] - logits.logsumexp(dim=-1, keepdim=True)


def top_logprobs(logits: torch.Tensor, k: int) -> TopLogprobs:
    """The k largest log-probabilities per row of logits [N, V] (k capped at V), descending."""
    if k < 0:
        raise ValueError(f"k must be >= 0; got {k}")
    logits = logits.float()
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return TopLogprobs(values - logits.logsumexp(dim=-1, keepdim=True), ids)
