"""Collects a request's input and output logprobs as its chunks and tokens are computed.

Entries are (logprob, token_id); the first input entry's logprob is None (no logits predict
the first scored position), as in SGLang. Each position also gets its top-k entries and, with
SGLang's token_ids_logprob, the entries of those ids (None at the first input position).
Input entries cover prompt positions `start_len .. prompt_len - 1`; the scheduler never
serves those positions from the cache.

Output tokens that a grammar forced (jump-forward: appended unsampled) get, as in SGLang,
the logprob the model gives them, read from the row that predicts each one once the extend
computing them has run: every output entry is its token under the unmasked logits. Forced
tokens that end the request (max_new_tokens or a stop string reached inside forced text) are
never computed: their logprob is None, as for the first prompt position.
"""

from __future__ import annotations

import torch

from radixserve.engine.request import Req
from radixserve.sampling.logprobs import (
    picked_logprobs,
    token_logprobs,
    token_ranks,
    top_logprobs,
)


def commit_logprobs(
    req: Req,
    chunk_start: int,
    chunk_logits: torch.Tensor | None,
    last_logits: torch.Tensor,
    token: int | None,
) -> None:
    """chunk_logits: [num_new, vocab] logits of the chunk starting at `chunk_start`, or None."""
    if req.wants_input_logprobs and chunk_logits is not None:
        _commit_input(req, chunk_start, chunk_logits)
    if chunk_logits is not None:
        _commit_forced(req, chunk_start, chunk_logits)
    if token is not None:
        _commit_output(req, last_logits, token)


def needs_all_logits(req: Req) -> bool:
    """Whether the request's next extend must return the logits of every row: it scores
    prompt positions, or forced output tokens wait for theirs."""
    if req.logprob is None:
        return False
    scores_prompt = req.wants_input_logprobs and req.num_computed < len(req.input_ids)
    return scores_prompt or len(req.output_logprobs) < len(req.output_ids)


def cacheable_len(req: Req) -> int | None:
    """Most leading tokens of the request's sequence the prefix cache may serve: the rows
    of the positions it scores (prompt positions, forced output tokens still without a
    logprob) must be computed. None: no limit."""
    limits = []
    if req.wants_input_logprobs:
        limits.append(min(req.logprob.start_len, req.seq_len - 1))
    if req.logprob is not None and len(req.output_logprobs) < len(req.output_ids):
        limits.append(len(req.input_ids) + len(req.output_logprobs) - 1)
    return min(limits, default=None)


def fill_unscored(req: Req) -> None:
    """A request that ended with forced output tokens still uncomputed: None for theirs."""
    missing = req.output_ids[len(req.output_logprobs) :]
    req.output_logprobs.extend((None, token) for token in missing)
    req.output_top_logprobs.extend(None for _ in missing)
    req.output_token_ids_logprobs.extend(None for _ in missing)


def replace_last_output(req: Req, num_replaced: int, last_logits: torch.Tensor, token: int) -> None:
    """Drops the last `num_replaced` output entries and scores `token` in their place with
    `last_logits` (the row that predicted the first of them)."""
    if num_replaced:
        del req.output_logprobs[-num_replaced:]
        del req.output_top_logprobs[-num_replaced:]
        del req.output_token_ids_logprobs[-num_replaced:]
    _commit_output(req, last_logits, token)


def _commit_input(req: Req, chunk_start: int, chunk_logits: torch.Tensor) -> None:
    prompt_len = len(req.input_ids)
    start = req.logprob.start_len
    if start >= prompt_len:
        return
    if not req.input_logprobs:
        req.input_logprobs.append((None, req.input_ids[start]))
        req.input_top_logprobs.append(None)
        req.input_token_ids_logprobs.append(None)
        if req.logprob.ranks:
            req.input_ranks.append(None)
    first = max(chunk_start + 1, start + len(req.input_logprobs))
    last = min(chunk_start + chunk_logits.shape[0], prompt_len - 1)
    if first > last:
        return
    rows = chunk_logits[first - 1 - chunk_start : last - chunk_start]
    ids = torch.tensor(req.input_ids[first : last + 1], device=rows.device)
    values = token_logprobs(rows, ids).tolist()
    req.input_logprobs.extend(zip(values, ids.tolist()))
    req.input_top_logprobs.extend(_tops(rows, req.logprob.top_num))
    req.input_token_ids_logprobs.extend(_picked(rows, req.logprob.token_ids))
    if req.logprob.ranks:
        req.input_ranks.extend(token_ranks(rows, ids).tolist())


def _commit_forced(req: Req, chunk_start: int, chunk_logits: torch.Tensor) -> None:
    """Scores the output tokens still without a logprob whose predicting rows are in the
    chunk (row r predicts sequence position chunk_start + r + 1)."""
    prompt_len = len(req.input_ids)
    first = len(req.output_logprobs)  # output index k sits at position prompt_len + k
    end = min(len(req.output_ids), chunk_start + chunk_logits.shape[0] + 1 - prompt_len)
    if first >= end or prompt_len + first - 1 < chunk_start:
        return
    rows = chunk_logits[prompt_len + first - 1 - chunk_start : prompt_len + end - 1 - chunk_start]
    ids = torch.tensor(req.output_ids[first:end], device=rows.device)
    values = token_logprobs(rows, ids).tolist()
    req.output_logprobs.extend(zip(values, ids.tolist()))
    req.output_top_logprobs.extend(_tops(rows, req.logprob.top_num))
    req.output_token_ids_logprobs.extend(_picked(rows, req.logprob.token_ids))


def _commit_output(req: Req, last_logits: torch.Tensor, token: int) -> None:
    row = last_logits.unsqueeze(0)
    value = token_logprobs(row, torch.tensor([token], device=row.device)).item()
    req.output_logprobs.append((value, token))
    req.output_top_logprobs.extend(_tops(row, req.logprob.top_num))
    req.output_token_ids_logprobs.extend(_picked(row, req.logprob.token_ids))


def _tops(rows: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    if k <= 0:
        return [[] for _ in range(rows.shape[0])]
    values, ids = top_logprobs(rows, k)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]


def _picked(rows: torch.Tensor, token_ids: tuple[int, ...]) -> list[list[tuple[float, int]]]:
    """Per row, the logprobs of `token_ids` in their order (empty lists when none asked)."""
    if not token_ids:
        return [[] for _ in range(rows.shape[0])]
    values = picked_logprobs(rows, torch.tensor(token_ids, device=rows.device)).tolist()
    return [list(zip(row, token_ids)) for row in values]
