"""EAGLE-2 style draft trees for EAGLE-3 and EAGLE-1/2 heads (--speculative-eagle-topk > 1).

    step 1 (eagle.py)   the head over the pending columns -> top-k children of the root
    steps 2 .. S        the k frontier nodes in one head forward (each attends to the kept
                        columns, its ancestors' columns and itself, at position n - 1 + depth)
                        -> top-k children each; the k best by cumulative draft probability
                        (the product along the path) become the next frontier
    prune               the num_nodes best candidates of all steps (a child never scores above
                        its parent, so they form a tree), in creation order: parents first

The drafts are deterministic (q one-hot), for sampled requests too: tree_verify.py's tree
rejection sampling keeps the output distribution exact.
"""

from __future__ import annotations

import torch

from radixserve.engine.speculative.drafter import Draft
from radixserve.model.eagle_head import HeadStep


def draft_trees(
    head,
    first: HeadStep,
    key_valid: torch.Tensor,
    last_positions: torch.Tensor,
    topk: int,
    num_steps: int,
    num_nodes: int,
) -> list[Draft]:
    """One tree per request from step 1's output `first` (logits [B, V] at each request's
    last column, K/V of its columns valid where `key_valid` [B, T0]); `last_positions` [B, 1]:
    the position of each request's last column."""
    batch, device = first.logits.shape[0], first.logits.device
    scores, tokens = first.logits.softmax(dim=-1).topk(topk, dim=-1)  # [B, k]
    all_scores, all_tokens = [scores], [tokens]
    all_parents = [torch.zeros_like(tokens)]  # node ids: candidate id + 1, 0 the root
    frontier_ids = torch.arange(topk, device=device).expand(batch, topk)
    hidden = first.hidden[:, -1:].expand(batch, topk, first.hidden.shape[-1])
    keys, values = first.keys, first.values
    base_valid = key_valid[:, None, :].expand(batch, topk, key_valid.shape[1])
    ancestors = torch.zeros(batch, topk, 0, dtype=torch.bool, device=device)
    self_cols = torch.eye(topk, dtype=torch.bool, device=device).expand(batch, topk, topk)
    offset = topk
    for depth in range(1, num_steps):
        mask = torch.cat([base_valid, ancestors, self_cols], dim=2)[:, None]
        positions = (last_positions + depth).expand(batch, topk)
        step = head(hidden, tokens, positions, (keys, values), mask, all_logits=True)
        keys, values = step.keys, step.values
        child_p, child_t = step.logits.softmax(dim=-1).topk(topk, dim=-1)  # [B, k, k]
        cumulative = (scores[:, :, None] * child_p).flatten(1)  # [B, k * k]
        all_scores.append(cumulative)
        all_tokens.append(child_t.flatten(1))
        all_parents.append((frontier_ids[:, :, None] + 1).expand(batch, topk, topk).flatten(1))
        if depth + 1 == num_steps:
            break
        scores, pick = cumulative.topk(topk, dim=-1)  # the next frontier [B, k]
        source = pick // topk  # which frontier node each one's parent is
        width = ancestors.shape[2]
        ancestors = torch.cat(
            [
                ancestors.gather(1, source[..., None].expand(batch, topk, width)),
                torch.nn.functional.one_hot(source, topk).bool(),  # the parent's column
            ],
            dim=2,
        )
        hidden = step.hidden.gather(1, source[..., None].expand(batch, topk, hidden.shape[-1]))
        tokens = child_t.flatten(1).gather(1, pick)
        frontier_ids = offset + pick
        offset += topk * topk
    return _prune(
        torch.cat(all_scores, 1), torch.cat(all_tokens, 1), torch.cat(all_parents, 1), num_nodes
    )


def _prune(
    scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: int
) -> list[Draft]:
    """Each request's `num_nodes` best candidates, in creation order, as a Draft tree (a
    candidate whose parent lost a tie is dropped)."""
    num = min(num_nodes, scores.shape[1])
    keep = scores.float().topk(num, dim=-1).indices.sort(dim=-1).values.tolist()
    tokens, parents = tokens.tolist(), parents.tolist()
    drafts = []
    for b, chosen in enumerate(keep):
        node_of = {0: 0}  # candidate node id -> node index in the draft
        draft_tokens, draft_parents = [], []
        for cand in chosen:
            parent = node_of.get(parents[b][cand])
            if parent is None:
                continue
            draft_tokens.append(tokens[b][cand])
            draft_parents.append(parent)
            node_of[cand + 1] = len(draft_tokens)
        drafts.append(Draft(draft_tokens, None, draft_parents))
    return drafts
