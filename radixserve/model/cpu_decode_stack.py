"""A decode step's decoder layers as one C++ call (native/csrc/decode_stack.cpp), and a short
in-place extend's (a speculative verify: a chain or a draft tree over the cached pages).

On CPU an eager decode step pays Python around ~12 ops a layer: a dozen module calls, the
quantized layers' checks, the attention backend's routing (~2-3 ms of a ~36 ms 1B step, a
fifth of the default model's; docs/performance.md, "The decode stack"). `CpuDecodeStack`
reads, once at start-up, what those modules pass to their ops (norm weights, each
projection's kernel and weight tensors) into a `torch.classes.radixserve_cpu.DecodeStack`,
which then runs every layer of a pure decode batch in one call: the same ops, in the same
order, on the same tensors, so the same bits.

It covers the common case only, and `build_decode_stack` says why when it does not apply:
a float32 Llama / Qwen (no sliding window) on the fused CPU ops and the `cpu_fused` backend,
one rank, dense SiLU MLPs, projections that are fp layers (torch's matmul or the packed
kernel of --cpu-dense-kernel) or GGUF-block layers (K-quants, Q4_0 / Q4_1 / Q8_0, repacked or
not). Per step `run` falls back to the modules (returns None) for anything but a batch of
only decodes or only in-place extends (cpu_fused routes an extend over cached tokens, and every
verify, to paged_extend) below every layer's dense-matmul row count, a LoRA batch and SELF
speculation's layer subset. EAGLE's captured hidden states come out of the stack too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.forward_batch import ForwardBatch
from radixserve.model.quant.base_linear import QuantizedLinear, UnquantizedLinear
from radixserve.model.quant.batch_invariant import BatchInvariantLinear
from radixserve.model.quant.kquant import KQuantLinear
from radixserve.model.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from radixserve.model.quant.stacked_linear import StackedLinear

logger = logging.getLogger(__name__)

# decode_stack.cpp's PartKind (its Projection: the index in build_decode_stack's tuple)
DENSE, KQUANT, KQUANT_Q8, INT4, INT4_Q8, INT4_X8_Q8, INT8, INT8_Q8, PACKED = range(9)
CPU_DECODE_STACK_CHOICES = ("auto", "off")


@dataclass(frozen=True)
class Part:
    """One kernel call of a projection: `kind`'s op on (a, b, qtype), then `row_order`, then
    `bias` (what the layer's forward does after its `_matmul`)."""

    kind: int
    a: torch.Tensor
    b: torch.Tensor | None = None
    qtype: int = 0
    row_order: torch.Tensor | None = None
    bias: torch.Tensor | None = None


class Unsupported(ValueError):
    """The model or a layer is outside what the C++ stack runs; the message says what."""


def linear_parts(linear: nn.Module) -> list[Part]:
    """The kernel calls `linear` makes on a few fp32 rows (fewer than its dense-matmul row
    count), as Parts; raises Unsupported for a layer the stack does not run."""
    if isinstance(linear, StackedLinear):
        return [part for p in linear.parts for part in linear_parts(p)]
    if isinstance(linear, UnquantizedLinear):
        if linear.weight.dtype != torch.float32:
            raise Unsupported(f"a {linear.weight.dtype} fp layer")
        return [Part(DENSE, linear.weight, bias=linear.bias)]
    if isinstance(linear, BatchInvariantLinear) and linear._kernel:  # --cpu-dense-kernel packed
        packed, bias = linear._buffers["packed_weight"], linear._buffers["bias"]
        return [Part(PACKED, packed, None, linear.out_features, bias=bias)]
    if not isinstance(linear, QuantizedLinear) or linear.compute_dtype is not None:
        raise Unsupported(f"{type(linear).__name__} layers")
    buffers, q8 = linear._buffers, linear.int8_activations
    if isinstance(linear, KQuantLinear):
        kind = KQUANT_Q8 if q8 else KQUANT
        order, bias = buffers["row_order"], buffers["bias"]
        return [Part(kind, buffers["blocks"], None, linear.qtype, order, bias)]
    if isinstance(linear, Int4WeightOnlyLinear) and linear.backend == "blocks":
        if linear.x8_type is not None and q8:
            return [Part(INT4_X8_Q8, linear.x8, None, linear.x8_type, bias=buffers["bias"])]
        if linear.x8_type is not None:
            raise Unsupported("repacked int4 layers on fp32 activations")
        kind = INT4_Q8 if q8 else INT4
        return [Part(kind, buffers["qs"], buffers["scale_min"], bias=buffers["bias"])]
    if isinstance(linear, Int8WeightOnlyLinear) and linear.backend == "blocks":
        kind = INT8_Q8 if q8 else INT8
        return [Part(kind, buffers["qweight"], buffers["scales"], bias=buffers["bias"])]
    backend = getattr(linear, "backend", "?")
    raise Unsupported(f"{type(linear).__name__} layers of backend {backend}")


def _dense_rows(linear: nn.Module) -> int | None:
    """From how many rows `linear` leaves its kernels for a dense matmul (None: never)."""
    if isinstance(linear, StackedLinear):
        rows = [r for p in linear.parts if (r := _dense_rows(p)) is not None]
        return min(rows, default=None)
    return getattr(linear, "dequant_min_rows", None)


class CpuDecodeStack:
    """The model's layers in a DecodeStack; `run` takes a pure decode batch's embeddings."""

    def __init__(self, attn, stack, max_rows: int | None):
        self.stack = stack
        self.max_rows = max_rows  # rows from which some layer would dequantize instead
        kv = [attn.pool.layer_kv(i) for i in range(stack.num_layers())]  # views made at start
        self.k_pools, self.v_pools = [k for k, _ in kv], [v for _, v in kv]
        self.calls = 0  # steps run by the stack (tests, benchmarks)

    def run(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
        aux_layers: list[int] | None = None,
    ) -> list[torch.Tensor] | None:
        """[last MLP output, residual, the residual stream entering each of `aux_layers`
        (ascending, 0 .. num_layers)] of every layer for a batch of only decodes or only
        in-place extends; None when the batch is not one the stack runs (the modules run it)."""
        meta = getattr(batch, "attn_metadata", None)
        if meta is None or meta.extends or batch.lora is not None:
            return None
        if hidden.dtype != torch.float32:
            return None
        if self.max_rows is not None and hidden.shape[0] >= self.max_rows:
            return None
        decode, ext, aux = meta.decode, meta.in_place, aux_layers or []
        if decode is not None and ext is None and decode.token_idx is None:
            out = self.stack.forward(
                hidden, cos, sin, batch.out_slots, self.k_pools, self.v_pools,
                decode.page_table, decode.seq_lens, batch.page_size, aux,
            )  # fmt: skip
        elif decode is None and ext is not None and ext.token_idx is None:
            out = self.stack.forward_extend(
                hidden, cos, sin, batch.out_slots, self.k_pools, self.v_pools, ext.page_table,
                ext.q_starts, ext.prefix_lens, ext.extend_lens, ext.page_rows,
                ext.tree_parents, batch.page_size, aux,
            )  # fmt: skip
        else:
            return None
        self.calls += 1
        return out


def build_decode_stack(model: nn.Module, attn) -> CpuDecodeStack:
    """The C++ stack of `model`'s layers on `attn`; raises Unsupported naming what is not."""
    from radixserve.attention.cpu_fused import CpuFusedBackend
    from radixserve.model.layers import GatedMLP
    from radixserve.model.llama import LlamaDecoderLayer, LlamaForCausalLM
    from radixserve.native.extension import load_cpu_ops

    if type(attn) is not CpuFusedBackend or attn.deterministic:
        raise Unsupported(f"the {type(attn).__name__} attention backend")
    if not isinstance(model, LlamaForCausalLM) or model.tp.size != 1:
        raise Unsupported("tensor parallelism" if model.tp.size != 1 else type(model).__name__)
    if model.embed_scale is not None or model.local_rotary is not None:
        raise Unsupported(type(model).__name__)
    layers = list(model.layers)
    first = layers[0].self_attn
    load_cpu_ops()
    stack = torch.classes.radixserve_cpu.DecodeStack(
        first.num_heads, first.num_kv_heads, first.head_dim, first.eps,
        attn.window, attn.scale, attn.cap,
    )  # fmt: skip
    dense_rows: list[int] = []
    for layer in layers:
        sa, mlp = layer.self_attn, layer.mlp
        if type(layer) is not LlamaDecoderLayer or layer.local_rope:
            raise Unsupported(type(layer).__name__)
        if type(mlp) is not GatedMLP or mlp.gelu_tanh or mlp.ops is None or sa.ops is None:
            raise Unsupported("MoE, GeLU or unfused MLPs" if sa.ops is not None else "no fused ops")
        if sa.q_scale is not None or layer.input_layernorm.eps != sa.eps:
            raise Unsupported("scaled queries or per-norm eps")
        q_norm = None if sa.q_norm is None else sa.q_norm.weight.detach()
        k_norm = None if sa.k_norm is None else sa.k_norm.weight.detach()
        stack.add_layer(
            layer.input_layernorm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            q_norm,
            k_norm,
        )
        projections = (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)
        for index, linear in enumerate(projections):
            for p in linear_parts(linear):
                stack.add_part(index, p.kind, p.a, p.b, p.qtype, p.row_order, _detach(p.bias))
            if (rows := _dense_rows(linear)) is not None:
                dense_rows.append(rows)
    return CpuDecodeStack(attn, stack, min(dense_rows, default=None))


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def check_cpu_decode_stack(choice: str) -> None:
    if choice not in CPU_DECODE_STACK_CHOICES:
        allowed = ", ".join(CPU_DECODE_STACK_CHOICES)
        raise ValueError(f"--cpu-decode-stack must be one of {allowed}; got {choice!r}")


def use_cpu_decode_stack(model: nn.Module, attn, choice: str) -> CpuDecodeStack | None:
    """--cpu-decode-stack -> `model.decode_stack` (None: the modules run every step)."""
    from radixserve.native.extension import CpuExtensionUnavailable

    check_cpu_decode_stack(choice)
    stack = None
    if choice == "auto":
        try:
            stack = build_decode_stack(model, attn)
        except (Unsupported, CpuExtensionUnavailable) as exc:
            logger.info("decode steps run the layer modules (no C++ decode stack): %s", exc)
    if hasattr(model, "decode_stack"):
        model.decode_stack = stack
    return stack
