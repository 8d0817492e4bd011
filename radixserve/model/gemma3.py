"""Gemma 3 (text): the Llama layer with Gemma's norms, scales and interleaved sliding windows.

What differs from LlamaForCausalLM (ModelConfig.gemma carries the options):
- four RMSNorms per layer, each `x * (1 + w)`: input, post-attention (on the attention output,
  before the residual add), pre- and post-feedforward;
- q/k RMSNorm before RoPE, scores scaled by query_pre_attn_scalar ** -0.5;
- sliding layers (config.sliding_layers) attend within `sliding_window` and rotate with their
  own RoPE base (rope_local_base_freq, unscaled); the global layers take rope_theta/scaling;
- embeddings times sqrt(hidden_size) (rounded to the model dtype, as transformers);
- GeLU (tanh) MLP; logits soft-capped when final_logit_softcapping is set;
- attention scores soft-capped when attn_logit_softcapping is set: by the attention backend
  (ModelConfig.attn_logit_cap -> AttentionBackend.logit_cap).

Norm weights are stored as (1 + w) at load time, so the shared RMSNorm (and its fused CPU
op) computes Gemma's norm: exact in fp32, one rounding of (1 + w) in bf16.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from radixserve.attention.base import AttentionBackend
from radixserve.config import ModelConfig
from radixserve.distributed.group import TPGroup
from radixserve.forward_batch import ForwardBatch
from radixserve.model.layers import GatedMLP, RMSNorm, RotaryAt, RotaryEmbedding
from radixserve.model.llama import LlamaAttention, LlamaForCausalLM
from radixserve.model.tp_shard import ShardLayout


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, layout: ShardLayout, tp: TPGroup):
        super().__init__()
        self.local_rope = layer in config.sliding_layers
        self.self_attn = LlamaAttention(config, layer, layout, tp)
        self.mlp = GatedMLP(config.hidden_size, layout.intermediate_size, False, tp, True)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps))

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        rotary: RotaryAt,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaDecoderLayer's residual-stream contract; the attention and MLP outputs are
        normed before they join the stream."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, batch, rotary, attn))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden, batch.lora)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma3ForCausalLM (model_type gemma3_text) on the Llama model's forward and loading."""

    decoder_layer = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        super().__init__(config, tp)
        dtype = self.embed_tokens.weight.dtype
        scale = torch.tensor(config.hidden_size**0.5, dtype=dtype, device="cpu")
        self.embed_scale = float(scale)
        local = dataclasses.replace(
            config, rope_theta=config.gemma.local_rope_theta, rope_scaling=None
        )
        self.local_rotary = RotaryEmbedding(local)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.gemma.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_one_plus_norms(weights))


def _one_plus_norms(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma's norm weights w as (1 + w), computed in fp32 as its norm does."""
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = (1.0 + tensor.float()).to(tensor.dtype)
        yield name, tensor
