"""The Llama family (Llama, Mistral, Qwen2, Qwen3; their MoE siblings Qwen2-MoE, Qwen3-MoE
and Mixtral), written for a paged KV pool.

One class covers them all; ModelConfig carries the differences: qkv bias (Qwen2), per-head
q/k RMSNorm before RoPE (Qwen3), sliding window (Mistral, applied by the attention backend),
tied embeddings, routed experts in place of some MLPs (model/moe.py). q/k/v and gate/up are
fused into single matmuls; `load_weights` maps the HF checkpoint names onto the fused
parameters (experts: model/moe_weights.py). Under tensor parallelism (`tp`, `layout`) each
rank builds only its shard (model/tp_shard.py) and the loader hands it only its part of each
checkpoint tensor; one all-reduce follows o_proj and one down_proj.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixserve.attention.base import AttentionBackend
from radixserve.config import ModelConfig
from radixserve.distributed.group import TPGroup
from radixserve.forward_batch import ForwardBatch
from radixserve.model.cpu_decode_stack import CpuDecodeStack
from radixserve.model.cpu_layer_ops import CpuLayerOps
from radixserve.model.layers import (
    DirectCallModule,
    GatedMLP,
    RMSNorm,
    RotaryAt,
    RotaryEmbedding,
    VocabParallelEmbedding,
)
from radixserve.model.lora import LoraLayer, LoraWeights
from radixserve.model.moe import SparseMoeBlock
from radixserve.model.moe_weights import SKIP, map_moe_name, moe_mlp_shapes, moe_num_parts
from radixserve.model.quant.linear import UnquantizedLinear
from radixserve.model.tp_shard import ShardLayout


class LlamaAttention(DirectCallModule):
    def __init__(self, config: ModelConfig, layer: int, layout: ShardLayout, tp: TPGroup):
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = UnquantizedLinear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = UnquantizedLinear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Gemma 3 scales scores by query_pre_attn_scalar ** -0.5; backends by head_dim ** -0.5
        q_scale = config.gemma.query_scale * self.head_dim**0.5 if config.gemma else 1.0
        self.q_scale = None if q_scale == 1.0 else q_scale
        self.eps = config.rms_norm_eps
        self.ops: CpuLayerOps | None = None
        self.lora: LoraLayer | None = None  # set by use_lora; used when batch.lora is set

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryAt,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if batch.lora is not None:
            self.lora.qkv.add_to(qkv, hidden, batch.lora)
        # [num_tokens, heads + 2 * kv_heads, head_dim] -> q, k, v views: two ops, not four
        heads = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.ops is not None and attn.accepts_stored_kv and not torch.compiler.is_compiling():
            self._rope_store(qkv, batch, rotary, attn)  # q, k (views of qkv) rotated in place
            if self.q_scale is not None:
                q.mul_(self.q_scale)
            out = attn.forward_stored(q, k, v, self.layer, batch)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(q, k)
            if self.q_scale is not None:
                q = q * self.q_scale
            out = attn.forward(q, k, v, self.layer, batch)
        out = out.reshape(num_tokens, self.q_size)
        projected = self.o_proj(out)
        if batch.lora is not None:
            self.lora.o.add_to(projected, out, batch.lora)
        return self.tp.all_reduce(projected)

    def _rope_store(
        self, qkv: torch.Tensor, batch: ForwardBatch, rotary: RotaryAt, attn: AttentionBackend
    ) -> None:
        """The fused op: qk norms and RoPE in place in `qkv`, k and v into the pool."""
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        kv, out_slots = attn.store_target(self.layer, batch)
        self.ops.rope_store(
            qkv, rotary.cos, rotary.sin, kv, out_slots,
            (self.num_heads, self.num_kv_heads, self.head_dim), qk_norm, self.eps,
        )  # fmt: skip


class LlamaDecoderLayer(DirectCallModule):
    local_rope = False  # True: RoPE of the model's `local_rotary` (Gemma 3's sliding layers)

    def __init__(self, config: ModelConfig, layer: int, layout: ShardLayout, tp: TPGroup):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, layout, tp)
        if config.is_sparse_layer(layer):
            self.mlp = SparseMoeBlock(config.hidden_size, config.moe, tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, layout.intermediate_size, config.mlp_bias, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        rotary: RotaryAt,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual stream: returns (this layer's MLP output, the residual before it);
        the next norm adds them (None: `hidden` is the embedding, the residual itself)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch, rotary, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, batch.lora), residual


FINAL_HIDDEN = -1  # an aux layer id: the final-normed hidden states (EAGLE-1/2's feature)


class LlamaForCausalLM(nn.Module):
    """Token ids of a ForwardBatch -> final hidden states; `compute_logits` applies the LM head."""

    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    local_rotary: RotaryEmbedding | None = None  # Gemma 3: the sliding layers' RoPE
    decode_stack: CpuDecodeStack | None = None  # pure decode batches' layers in one C++ call

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.config = config
        self.tp = tp = tp or TPGroup.single()
        self.layout = layout = ShardLayout(config, tp.rank, tp.size)
        self.embed_tokens = VocabParallelEmbedding(
            layout.vocab_size, config.hidden_size, layout.vocab_start, tp
        )
        self.layers = nn.ModuleList(
            self.decoder_layer(config, i, layout, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = UnquantizedLinear(config.hidden_size, layout.vocab_size, bias=False)
        self.score = None  # a sequence classifier's head over the last token (--is-embedding)
        if config.num_labels is not None:
            self.score = UnquantizedLinear(config.hidden_size, config.num_labels, bias=False)
        self.rotary = RotaryEmbedding(config)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Returns final-normed hidden states [num_tokens, hidden_size]."""
        return self.forward_layers(batch, attn, self.layers)

    def forward_layers(
        self,
        batch: ForwardBatch,
        attn: AttentionBackend,
        layers: Iterable[LlamaDecoderLayer],
        aux_layers: tuple[int, ...] = (),
        aux: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`forward` through `layers` (all, or SELF speculation's first ones), then the norm.
        EAGLE-3: the residual stream entering each layer index in `aux_layers` (the number of
        layers: after the last) is appended to `aux` [num_tokens, hidden_size] each; EAGLE-1/2:
        FINAL_HIDDEN, the final-normed hidden states (the LM head's input)."""
        hidden = self.embed_tokens(batch.input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        rotary = self.rotary.at(batch.positions)
        local = rotary if self.local_rotary is None else self.local_rotary.at(batch.positions)
        if self.decode_stack is not None and layers is self.layers:
            stacked = sorted({i for i in aux_layers if i != FINAL_HIDDEN})
            out = self.decode_stack.run(hidden, batch, rotary.cos, rotary.sin, stacked)
            if out is not None:  # [last MLP output, residual, *aux]; None: the modules run it
                hidden = self.norm(out[0], out[1])[0]
                if aux_layers:
                    captured = dict(zip(stacked, out[2:]))
                    captured[FINAL_HIDDEN] = hidden
                    aux.extend(captured[i] for i in aux_layers)
                return hidden
        residual = None
        captured: dict[int, torch.Tensor] = {}
        num_layers = 0
        for i, layer in enumerate(layers):
            if i in aux_layers:
                captured[i] = _residual_stream(hidden, residual)
            layer_rotary = local if layer.local_rope else rotary
            hidden, residual = layer(hidden, residual, batch, layer_rotary, attn)
            num_layers = i + 1
        if num_layers in aux_layers:
            captured[num_layers] = _residual_stream(hidden, residual)
        hidden = self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]
        if aux_layers:
            captured[FINAL_HIDDEN] = hidden
            aux.extend(captured[i] for i in aux_layers)  # a layer may be named twice
        return hidden

    def use_cpu_layer_ops(self, ops: CpuLayerOps | None) -> None:
        """Eager CPU forwards run norms, SiLU * mul and RoPE + the K/V write as fused C++ ops
        (model/cpu_layer_ops.py); None: the torch reference everywhere."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, GatedMLP, LlamaAttention, SparseMoeBlock)):
                module.ops = ops

    def use_lora(self, weights: LoraWeights | None) -> None:
        """Serves the adapters of `weights` on the batches whose `lora` names them."""
        loras = weights.layers if weights is not None else [None] * len(self.layers)
        for layer, lora in zip(self.layers, loras):
            layer.self_attn.lora = layer.mlp.lora = lora

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> fp32 logits [n, vocab_size] (each rank's vocab rows, gathered)."""
        return self.tp.all_gather_last_dim(self._local_logits(hidden))

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight as one dense [vocab rows, hidden] tensor, wherever it lives:
        an fp head's parameter or a tied fp embedding's table (themselves, no copy); a
        batch-invariant head's packed weight unpacked; a quantized head, or a tied embedding
        kept as GGUF blocks (BlockEmbedding, no fp table), dequantized (a copy). The one
        place that reads a tied head's weight."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        weight = getattr(head, "weight", None)
        if callable(weight) and not isinstance(weight, torch.Tensor):  # BatchInvariantLinear
            weight = weight()  # its packed copy, unpacked (deterministic inference)
        if isinstance(weight, torch.Tensor) and weight.is_floating_point():
            return weight
        table = getattr(head, "table", head)  # a BlockEmbedding: its block layer
        return table.dequantize(self.norm.weight.dtype)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding is the head
            return (hidden @ self.head_weight().t()).float()
        if isinstance(self.lm_head, UnquantizedLinear):
            return (hidden @ self.lm_head.weight.t()).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the (fused) parameters; raises on missing/unknown ones.
        Under tensor parallelism each tensor is already this rank's part (`layout.select`)."""
        params = dict(self.named_parameters())
        parts_loaded = dict.fromkeys(params, 0)
        for hf_name, tensor in weights:
            target = _map_hf_name(hf_name, self.layout)
            if target is None:
                continue
            name, rows = target
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}"
                )
            dest = params[name].data if rows is None else params[name].data[rows(self)]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            parts_loaded[name] += 1
        parts = {n: _num_parts(n, self.layout) for n in params}
        missing = sorted(n for n, count in parts_loaded.items() if count < parts[n])
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"checkpoint is missing tensors for {len(missing)} parameters: {shown}"
            )


def _residual_stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The sum the next norm would take (a copy: fused CPU norms write in place)."""
    return hidden.clone() if residual is None else hidden + residual


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a full HF checkpoint of `config`, in checkpoint order, with its shape."""
    hidden, hd = config.hidden_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    layer = {"input_layernorm.weight": (hidden,)}
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        layer[f"self_attn.{proj}.weight"] = (rows, hidden)
        if config.qkv_bias:
            layer[f"self_attn.{proj}.bias"] = (rows,)
    if config.qk_norm:
        layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    layer["self_attn.o_proj.weight"] = (hidden, q)
    if config.o_bias:
        layer["self_attn.o_proj.bias"] = (hidden,)
    layer["post_attention_layernorm.weight"] = (hidden,)
    if config.gemma is not None:
        layer |= {"pre_feedforward_layernorm.weight": (hidden,)}
        layer |= {"post_feedforward_layernorm.weight": (hidden,)}
    return _checkpoint_shapes(config, layer)


def _checkpoint_shapes(config: ModelConfig, layer: dict) -> dict[str, tuple[int, ...]]:
    """The whole checkpoint: embeddings, each layer's `layer` tensors plus its MLP, the head."""
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    dense = _dense_mlp_shapes(config)
    for i in range(config.num_layers):
        mlp = moe_mlp_shapes(config) if config.is_sparse_layer(i) else dense
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in (layer | mlp).items()}
    shapes["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def _dense_mlp_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    layer = {}
    for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden))):
        layer[f"mlp.{proj}.weight"] = shape
    layer["mlp.down_proj.weight"] = (hidden, inter)
    if config.mlp_bias:
        layer |= {"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,)}
        layer["mlp.down_proj.bias"] = (hidden,)
    return layer


# HF name part -> (our fused parameter part, rows of it that the HF tensor fills)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", lambda a: slice(0, a.q_size)),
    "self_attn.k_proj": ("self_attn.qkv_proj", lambda a: slice(a.q_size, a.q_size + a.kv_size)),
    "self_attn.v_proj": ("self_attn.qkv_proj", lambda a: slice(a.q_size + a.kv_size, None)),
    "mlp.gate_proj": ("mlp.gate_up_proj", lambda m: slice(0, m.gate_up_proj.out_features // 2)),
    "mlp.up_proj": ("mlp.gate_up_proj", lambda m: slice(m.gate_up_proj.out_features // 2, None)),
}


def _num_parts(param_name: str, layout: ShardLayout) -> int:
    """How many HF tensors fill this parameter."""
    if (experts := moe_num_parts(param_name, layout)) is not None:
        return experts
    if ".qkv_proj." in param_name:
        return 3
    return 2 if ".gate_up_proj." in param_name else 1


def _map_hf_name(hf_name: str, layout: ShardLayout):
    """HF tensor name -> (our parameter name, row selector or None); None means skip it."""
    config = layout.config
    if "rotary_emb" in hf_name:
        return None
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    name = hf_name.removeprefix("model.")
    if config.moe is not None and (moe := map_moe_name(name, layout)) is not None:
        return None if moe is SKIP else moe
    for hf_part, (ours, rows) in _FUSED.items():
        if f".{hf_part}." in name:
            layer = int(name.split(".")[1])
            owner = hf_part.split(".")[0]
            return name.replace(hf_part, ours), _rows_of(layer, owner, rows)
    return name, None


def _rows_of(layer: int, owner: str, rows):
    return lambda model: rows(getattr(model.layers[layer], owner))
