"""What a step cannot beat, from the model's shapes and the rates measured in the same run.

Decode is memory-bound: a step reads every weight once (the embedding table only at the
batch's rows, so it does not count, unless tied to the LM head) and the batch's KV once:

    t_decode  >= (weight_bytes + batch * context * kv_bytes_per_token) / copy bandwidth

Prefill is compute-bound: 2 FLOPs per weight per token, causal attention, the LM head on the
last token of each request:

    t_prefill >= flops / bf16 matmul rate

A decode step's FLOPs (`decode_flops`) bound it too once the batch is large enough (the CPU's
benchmarks/decode_roofline.py takes the max of both bounds).

`copy bandwidth` counts the bytes a device-to-device copy reads plus those it writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.config import ModelConfig


def layer_linear_params(config: ModelConfig) -> int:
    """Weights of one decoder layer's matmuls: fused qkv, o, fused gate/up, down."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    attn = config.hidden_size * (q_size + 2 * kv_size) + q_size * config.hidden_size
    mlp = 3 * config.hidden_size * config.intermediate_size
    return attn + mlp


def weight_bytes_read(config: ModelConfig, itemsize: int) -> int:
    """Bytes of weights one decode step reads: every layer, the norms, the LM head."""
    norms = (2 * config.num_layers + 1) * config.hidden_size
    lm_head = config.vocab_size * config.hidden_size
    return (config.num_layers * layer_linear_params(config) + norms + lm_head) * itemsize


def decode_bytes(config: ModelConfig, itemsize: int, batch: int, context: float) -> float:
    """Bytes a decode step of `batch` requests, each `context` tokens long, must read."""
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    return weight_bytes_read(config, itemsize) + batch * context * kv_per_token


def prefill_flops(
    config: ModelConfig, extend_lens: Sequence[int], prefix_lens: Sequence[int] | None = None
) -> float:
    """FLOPs of one prefill step: matmuls over every new token, causal attention over each
    request's context, and the LM head at each request's last token."""
    prefix_lens = prefix_lens or [0] * len(extend_lens)
    tokens = sum(extend_lens)
    linear = 2 * config.num_layers * layer_linear_params(config) * tokens
    pairs = sum(e * p + e * (e + 1) / 2 for e, p in zip(extend_lens, prefix_lens))
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * pairs
    lm_head = 2 * len(extend_lens) * config.vocab_size * config.hidden_size
    return linear + attention + lm_head


def decode_flops(config: ModelConfig, batch: int, context: int) -> float:
    """FLOPs of one decode step, one new token per request: every matmul and the LM head per
    row, attention (QK^T and PV) over each request's `context` cached tokens and its own."""
    lm_head = config.vocab_size * config.hidden_size
    linear = config.num_layers * layer_linear_params(config) + lm_head
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * (context + 1)
    return batch * (2 * linear + attention)
