"""EAGLE-3's training-time test: the head is unrolled `steps` times over packed sequences,
each step feeding its own output hidden state (and the next true token) back, with the
attention pattern the drafter (engine/speculative/eagle.py) uses at inference.

    step 0 at row i   (fc(aux_i), embed(x_{i+1}))  at position i      -> target p_{i+1}
    step k at row i   (prenorm_{k-1, i}, embed(x_{i+1+k})) at position i + k -> p_{i+1+k}
    step k attends    step 0's K/V of rows i - window + 1 .. i (same sequence, causal)
                      + steps 1 .. k's K/V of row i (its own chain: the "diagonal")

Loss per step: cross entropy of the head's draft-vocabulary distribution against the
target's (softmax of its logits over the draft vocabulary), where the target's top token is
in the draft vocabulary and the target position predicts a response token; step k weighs
0.8 ** k (SpecForge's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixserve.model.eagle3 import Eagle3Head

STEP_DECAY = 0.8


@dataclass
class Chunk:
    """Rows of one or more sequences packed end to end (`seq` tells them apart)."""

    ids: torch.Tensor  # [N] int64: x_i
    positions: torch.Tensor  # [N] int64: i's position in its sequence
    seq: torch.Tensor  # [N] int64
    aux: torch.Tensor  # [N, 3 * target hidden]
    target_row: torch.Tensor  # [N] int64: row of `targets` with p_i, -1: none
    targets: torch.Tensor  # [R, V_d] target logits over the draft vocabulary
    in_vocab: torch.Tensor  # [R] bool


@dataclass
class StepStats:
    loss: torch.Tensor  # the weighted sum over steps (a scalar with grad)
    correct: list[int]  # per step: rows whose top draft = the target's top token
    counted: list[int]  # per step: rows with a loss


def ttt_loss(head: Eagle3Head, chunk: Chunk, steps: int, window: int) -> StepStats:
    """The head unrolled `steps` times over `chunk` (see the module docstring)."""
    n = chunk.ids.shape[0]
    rows = torch.arange(n)
    base_mask = window_mask(chunk.seq, window)
    hidden = head.fuse(chunk.aux)  # [N, hidden]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    total = hidden.new_zeros(())
    correct, counted = [], []
    for k in range(steps):
        nxt = (rows + 1 + k).clamp(max=n - 1)
        valid = (rows + 1 + k < n) & (chunk.seq[nxt] == chunk.seq)
        with torch.no_grad():
            embeds = head.embed(torch.where(valid, chunk.ids[nxt], 0)).float()
        out, residual, key, value = _layer(head, embeds, hidden, chunk.positions + k, keys,
                                           values, base_mask)  # fmt: skip
        keys.append(key)
        values.append(value)
        normed, hidden = head.norm(out, residual)
        target_row = torch.where(valid, chunk.target_row[nxt], -1)
        has = target_row >= 0
        has[has.clone()] = chunk.in_vocab[target_row[has]]
        if has.any():
            logits = head.lm_head(normed[has])
            target = chunk.targets[target_row[has]].float()
            target_p = target.softmax(-1)
            loss = -(target_p * logits.log_softmax(-1)).sum(-1).mean()
            total = total + STEP_DECAY**k * loss
            correct.append(int((logits.argmax(-1) == target.argmax(-1)).sum()))
        else:
            correct.append(0)
        counted.append(int(has.sum()))
    return StepStats(total, correct, counted)


def window_mask(seq: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys step 0 lets each row read, in blocks of `window` rows: block b's rows see
    rows (b - 1) * window .. (b + 1) * window - 1 (the block before and their own), of
    them those of the same sequence, causal, at most `window` back (the padding rows past
    the chunk read each other, so no row's softmax is empty).
    [num_blocks, window, 2 * window] bool."""
    n = seq.shape[0]
    num_blocks = -(-n // window)
    rows = torch.arange(num_blocks * window).view(num_blocks, window, 1)
    cols = (torch.arange(num_blocks) * window - window).view(-1, 1, 1)
    cols = cols + torch.arange(2 * window).view(1, 1, -1)  # [B, 1, 2W]: each block's keys
    back = rows - cols
    seq_of = torch.cat([seq, seq.new_full((num_blocks * window - n,), -1)])  # padding: -1
    same = seq_of[rows] == seq_of[cols.clamp(min=0)]
    return (cols >= 0) & (back >= 0) & (back < window) & same


def _blocks(x: torch.Tensor, window: int, num_blocks: int) -> torch.Tensor:
    """[H, N, D] -> [H, B, 2W, D]: each block's keys (the block before it and its own),
    zero rows where there is none (masked)."""
    h, n, d = x.shape
    padded = torch.nn.functional.pad(x, (0, 0, window, num_blocks * window - n))
    blocks = padded.view(h, num_blocks + 1, window, d)
    return torch.cat([blocks[:, :-1], blocks[:, 1:]], dim=2)


def _layer(head: Eagle3Head, embeds, hidden, positions, keys, values, base_mask):
    """The midlayer over all rows at one step: its output, residual and this step's K/V.
    Step 0's K/V is read in blocks of the window (`base_mask`), the chain's row by row."""
    layer = head.midlayer
    attn = layer.self_attn
    n = embeds.shape[0]
    num_blocks, window = base_mask.shape[0], base_mask.shape[1]
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.reshape(n, attn.num_heads, attn.head_dim)
    k = k.reshape(n, attn.num_kv_heads, attn.head_dim)
    q, k = head.rotary.at(positions)(q, k)
    v = v.reshape(n, attn.num_kv_heads, attn.head_dim)
    groups = attn.num_heads // attn.num_kv_heads
    scale = 1.0 / math.sqrt(attn.head_dim)
    q = q.transpose(0, 1)  # [H, N, D]
    k0 = (keys[0] if keys else k).repeat_interleave(groups, dim=1).transpose(0, 1)
    v0 = (values[0] if values else v).repeat_interleave(groups, dim=1).transpose(0, 1)
    pad = num_blocks * window - n
    q_blocks = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(q.shape[0], num_blocks, window, -1)
    k_blocks, v_blocks = _blocks(k0, window, num_blocks), _blocks(v0, window, num_blocks)
    scores = (q_blocks @ k_blocks.transpose(-1, -2)) * scale  # [H, B, W, 2W]
    scores = scores.masked_fill(~base_mask, float("-inf"))
    chain_k = [*keys[1:], k] if keys else []  # steps 1 .. k: each row's own chain
    chain_v = [*values[1:], v] if values else []
    diag = [
        (q * ck.repeat_interleave(groups, dim=1).transpose(0, 1)).sum(-1, keepdim=True) * scale
        for ck in chain_k
    ]  # each [H, N, 1]
    diag = [torch.nn.functional.pad(d, (0, 0, 0, pad)).view(*scores.shape[:3], 1) for d in diag]
    probs = torch.cat([scores, *diag], dim=-1).softmax(-1)
    out = (probs[..., : 2 * window] @ v_blocks).reshape(q.shape[0], -1, q.shape[2])[:, :n]
    for j, cv in enumerate(chain_v):
        cv = cv.repeat_interleave(groups, dim=1).transpose(0, 1)
        p = probs[..., 2 * window + j].reshape(q.shape[0], -1, 1)[:, :n]
        out = out + p * cv
    out = attn.o_proj(out.transpose(0, 1).reshape(n, attn.q_size))
    out, residual = layer.post_attention_layernorm(out, hidden)
    return layer.mlp(out), residual, k, v
