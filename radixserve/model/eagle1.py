"""EAGLE-1/2 draft head in SGLang's layout (`llama_eagle.py`, EAGLE's `cnets.py`), on plain
tensors, no KV pool; EAGLE-2 drafts trees with the same head (engine/speculative/eagle_tree.py).

    target's final-normed hidden state f_p (the LM head's input, EAGLE's "feature")
    step     x = fc(cat(embed(token after p), f_p))            (2x hidden -> hidden, bias)
             one Llama decoder layer without input_layernorm (x is the residual)
             out = mlp(post_attention_layernorm(attn(x) + x)) + (attn(x) + x)
    logits   the target's LM head over `out` (no norm, no head of its own); `out` is the next
             draft step's f

Embeddings and LM head are the target's (as SGLang: a checkpoint's embed_tokens / lm_head
are not read). Attention: model/eagle_head.py, over K/V the drafter keeps per request.
"""

from __future__ import annotations

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
from radixserve.model.llama import FINAL_HIDDEN

WHAT = "EAGLE"


class EagleDecoderLayer(nn.Module):
    """A Llama decoder layer without input_layernorm (EAGLE's layer 0: fc's output enters
    attention as it is and is the residual)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = EagleAttention(config, config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, TPGroup.single())
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rotary, cache, mask):
        out, keys, values = self.self_attn(x, rotary, cache, mask)
        normed, residual = self.post_attention_layernorm(out, x)
        return self.mlp(normed) + residual, keys, values


class Eagle1Head(nn.Module):
    """The EAGLE-1/2 head over a target (an LlamaForCausalLM): its embeddings and LM head."""

    aux_layers = (FINAL_HIDDEN,)  # the runner captures the final-normed hidden states

    def __init__(self, config: ModelConfig, target):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList([EagleDecoderLayer(config)])
        self.rotary = RotaryEmbedding(config)
        self._target = (target,)  # not a submodule: its weights are the target's
        self.vocab_size = target.config.vocab_size

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, hidden] captured features -> the same rows in the head's dtype (fc mixes in
        each step's token, so it runs in `forward`)."""
        return aux.to(linear_weight(self.fc).dtype)

    def forward(self, hidden, tokens, positions, cache, mask, all_logits=False) -> HeadStep:
        """hidden [B, T, hidden] (the target's features or the previous step's output),
        tokens and positions [B, T] (the token after each feature's position, and that
        position); `all_logits`: logits at every new column [B, T, vocab]."""
        target = self._target[0]
        x = self.fc(torch.cat([target.embed_tokens(tokens).to(hidden.dtype), hidden], dim=-1))
        rotary = self.rotary.at(positions.reshape(-1))
        out, keys, values = self.layers[0](x, rotary, cache, mask)
        rows = out if all_logits else out[:, -1]
        logits = target.compute_logits(rows.reshape(-1, out.shape[-1]))
        return HeadStep(logits.view(*rows.shape[:-1], -1), out, keys, values)


def load_eagle1_head(path: str, target, device: torch.device, dtype: torch.dtype) -> Eagle1Head:
    """The head in folder `path` (config.json + *.safetensors: fc, layers.0.*) for the target
    model; refused, naming the flag, where its shapes do not fit the target."""
    _, config, tensors = read_head_folder(path, WHAT)
    target_hidden = target.config.hidden_size
    check_reads(tensors.get("fc.weight"), 2, target_hidden, WHAT)
    if config.hidden_size != target_hidden:
        raise ValueError(
            f"{FLAG}: the EAGLE head's hidden size {config.hidden_size} is not the target's "
            f"{target_hidden} (it drafts through the target's embeddings and LM head)"
        )
    for name in ("embed_tokens.weight", "lm_head.weight"):  # the target's are used
        tensors.pop(name, None)
    head = Eagle1Head(config, target)
    copy_weights(head, tensors, WHAT)
    return head.to(device=device, dtype=dtype).eval()
