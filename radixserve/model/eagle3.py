"""EAGLE-3 draft head in SGLang's layout (SpecForge output), on plain tensors, no KV pool.

    target aux hidden states (3 layers) --fc--> fused [hidden]     (once per target position)
    midlayer: qkv over cat(input_layernorm(embed(next token)), hidden_norm(fused))  (2x hidden)
              -> attention -> post_attention_layernorm (+ fused as residual) -> MLP
    norm(mlp, residual) -> (to the head's lm_head over draft_vocab_size, pre-norm sum -> next
    draft step's hidden state); draft id i means target id i + d2t[i].

Attention (model/eagle_head.py) runs with torch SDPA over K/V the caller passes in
(engine/speculative/eagle.py keeps each request's, capped at a window); `forward` returns it
with the new columns' K/V.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixserve.config import ModelConfig
from radixserve.distributed.group import TPGroup
from radixserve.model.eagle_head import (
    FLAG,
    EagleAttention,
    HeadStep,
    check_reads,
    copy_weights,
    linear_weight,
    read_head_folder,
)
from radixserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding

WHAT = "EAGLE-3"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """SGLang's default capture points: the residual stream entering layers 2, L/2, L-3."""
    return (2, num_layers // 2, num_layers - 3)


def aux_layers_from_config(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Capture points from `eagle_config.eagle_aux_hidden_state_layer_ids` (layer outputs,
    so each + 1 as SGLang), else the default; checked against the target's layers."""
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
    layers = default_aux_layers(num_layers) if ids is None else tuple(i + 1 for i in ids)
    if len(layers) != 3 or not all(0 <= i <= num_layers for i in layers):
        raise ValueError(
            f"{FLAG}: eagle_aux_hidden_state_layer_ids must name 3 of the target's "
            f"{num_layers} layers; got {ids}"
        )
    return layers


class Eagle3DecoderLayer(nn.Module):
    """SGLang's `midlayer`: the token's embedding and the fused hidden state, normed apart,
    concatenated into one 2x-hidden QKV input; the fused hidden state is the residual."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = EagleAttention(config, 2 * config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, TPGroup.single())
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, embeds, hidden, rotary, cache, mask):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        out, keys, values = self.self_attn(x, rotary, cache, mask)
        out, residual = self.post_attention_layernorm(out, hidden)
        return self.mlp(out), residual, keys, values


class Eagle3Head(nn.Module):
    """The draft head; embeddings (and the LM head, when it has none) are the target's."""

    def __init__(self, config: ModelConfig, target_hidden: int, draft_vocab: int, target):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, draft_vocab, bias=False)
        self.embed_tokens: nn.Embedding | None = None  # set when the checkpoint has its own
        self.rotary = RotaryEmbedding(config)
        self._target = (target,)  # not a submodule: its weights are the target's
        self.register_buffer("hot_ids", torch.arange(draft_vocab), persistent=False)
        self.vocab_size = target.config.vocab_size
        self.aux_layers = default_aux_layers(target.config.num_layers)  # the loader: config's

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, 3 * target hidden] captured aux hidden states -> [n, hidden]."""
        return self.fc(aux.to(linear_weight(self.fc).dtype))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        return self._target[0].embed_tokens(ids)

    def forward(self, hidden, tokens, positions, cache, mask, all_logits=False) -> HeadStep:
        """hidden [B, T, hidden] (fused or the previous step's pre-norm), tokens and
        positions [B, T] (the token after each hidden state's position, and that position);
        `all_logits`: logits at every new column [B, T, vocab] (a tree's frontier)."""
        rotary = self.rotary.at(positions.reshape(-1))
        out, residual, keys, values = self.midlayer(self.embed(tokens), hidden, rotary, cache, mask)
        normed, prenorm = self.norm(out, residual)
        logits = self._target_logits(normed if all_logits else normed[:, -1])
        return HeadStep(logits, prenorm, keys, values)

    def _target_logits(self, normed: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(normed).float()  # [B, draft_vocab]
        full = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.hot_ids, draft)


def load_eagle3_head(path: str, target, device: torch.device, dtype: torch.dtype) -> Eagle3Head:
    """The head in folder `path` (config.json + *.safetensors) for the target model (an
    LlamaForCausalLM); refused, naming the flag, where its shapes do not fit the target."""
    cfg, config, tensors = read_head_folder(path, WHAT)
    target_hidden = target.config.hidden_size
    check_reads(tensors.get("fc.weight"), 3, target_hidden, WHAT)
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    draft_vocab = cfg.get("draft_vocab_size") or target.config.vocab_size
    head = Eagle3Head(config, target_hidden, draft_vocab, target)
    head.aux_layers = aux_layers_from_config(cfg, target.config.num_layers)
    if "embed_tokens.weight" in tensors:
        head.embed_tokens = nn.Embedding(*tensors["embed_tokens.weight"].shape)
    elif config.hidden_size != target_hidden:
        raise ValueError(f"{FLAG}: a head without embeddings must have the target's hidden size")
    if "lm_head.weight" not in tensors:
        if draft_vocab != target.config.vocab_size:
            raise ValueError(f"{FLAG}: a head without lm_head must have the target's vocabulary")
        tensors["lm_head.weight"] = target.head_weight().detach()
    copy_weights(head, tensors, WHAT)
    if d2t is not None:
        head.hot_ids = d2t.long() + torch.arange(len(d2t))
    _check_vocab(head.hot_ids, draft_vocab, target.config.vocab_size)
    return head.to(device=device, dtype=dtype).eval()


def _check_vocab(hot_ids: torch.Tensor, draft_vocab: int, vocab: int) -> None:
    if len(hot_ids) != draft_vocab or int(hot_ids.min()) < 0 or int(hot_ids.max()) >= vocab:
        raise ValueError(
            f"{FLAG}: the head's d2t must map its {draft_vocab} draft ids into the target's "
            f"{vocab} token ids"
        )
