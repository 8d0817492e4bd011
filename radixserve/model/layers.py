"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP, and the
module base of a layer's parts (DirectCallModule)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.config import ModelConfig
from radixserve.distributed.group import TPGroup
from radixserve.forward_batch import LoraBatch
from radixserve.model.cpu_layer_ops import CpuLayerOps
from radixserve.model.lora import LoraLayer
from radixserve.model.quant.linear import UnquantizedLinear
from radixserve.native.machine import check_fits


class DirectCallModule(nn.Module):
    """An nn.Module whose call runs its `forward` directly, without nn.Module.__call__'s hook
    dispatch (two Python frames and a dozen checks a call). Nothing in radixserve registers
    hooks, and an eager decode step calls these modules ~9 times a layer: on a 1B model on
    CPU that dispatch was ~0.4 ms a step (docs/performance.md, "The decode step around its
    matmuls"). Forward hooks registered on these modules are not run."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class RMSNorm(DirectCallModule):
    """Normalizes in fp32, scales in the input dtype (as the HF reference does).

    With `residual` (the layer's residual stream), vLLM's fused_add_rms_norm contract:
    returns (rms_norm(x + residual), x + residual). With `ops` set (model/cpu_layer_ops.py),
    eager CPU calls run one C++ op instead of five to seven small ones, in place (x and
    residual are overwritten: both are the caller's own fresh tensors).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: CpuLayerOps | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.ops is not None and not torch.compiler.is_compiling():
            if residual is None:
                return self.ops.rms_norm(x, self.weight, self.eps)
            self.ops.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._normalize(x)
        x = x + residual
        return self._normalize(x), x

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GatedMLP(DirectCallModule):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul. Under tensor
    parallelism `intermediate_size` is this rank's share: gate/up are column-parallel, down
    row-parallel, and one all-reduce sums the ranks' partial outputs. With `ops` set, eager
    CPU calls run silu(gate) * up as one C++ op. `gelu_tanh`: GeLU (tanh approximation) in
    place of SiLU (Gemma's gelu_pytorch_tanh), in torch."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        tp: TPGroup,
        gelu_tanh: bool = False,
    ):
        super().__init__()
        self.tp = tp
        self.gelu_tanh = gelu_tanh
        self.gate_up_proj = UnquantizedLinear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = UnquantizedLinear(intermediate_size, hidden_size, bias=bias)
        self.ops: CpuLayerOps | None = None
        self.lora: LoraLayer | None = None  # set by LlamaForCausalLM.use_lora

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            self.lora.gate_up.add_to(gate_up, x, lora)
        if self.gelu_tanh:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        elif self.ops is not None and not torch.compiler.is_compiling():
            act = self.ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out = self.down_proj(act)
        if lora is not None:
            self.lora.down.add_to(out, act, lora)
        return self.tp.all_reduce(out)


class VocabParallelEmbedding(nn.Embedding):
    """Token embedding over this rank's rows [vocab_start, vocab_start + rows): ids outside
    them look up zeros, and an all-reduce assembles every token's row."""

    def __init__(self, rows: int, hidden_size: int, vocab_start: int, tp: TPGroup):
        super().__init__(rows, hidden_size)
        self.vocab_start = vocab_start
        self.tp = tp

    def reset_parameters(self) -> None:
        """No random init: the weights come from the checkpoint (or dummy weights). On the
        meta device nn.Embedding's normal_ would import torch._dynamo (~2 s of CPU a start)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] with the config's scaling (default, linear, llama3)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths / `factor`, short ones kept, a smooth band between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Neox-style (rotate-half) RoPE with a cos/sin table built on the positions' device.

    The table covers max_position_embeddings, or more if `reserve` asked for it up front:
    positions are never read on the host (that would be a sync in every layer, and is
    forbidden inside a CUDA graph).
    """

    def __init__(self, config: ModelConfig):
        self.inv_freq = rope_inv_freq(config)
        self.max_positions = config.max_position_embeddings
        self._cos: torch.Tensor | None = None  # [max_positions, head_dim] fp32
        self._sin: torch.Tensor | None = None

    def reserve(self, num_positions: int, device: torch.device) -> None:
        """Builds the table on `device` for at least `num_positions` positions."""
        self.max_positions = max(self.max_positions, num_positions)
        if self._cos is None or self._cos.device != device or len(self._cos) < num_positions:
            check_fits(  # t, freqs, emb, cos and sin at once: ~4 tables of fp32
                4 * self.max_positions * 2 * len(self.inv_freq) * 4,
                torch.device(device),
                f"a RoPE table of {self.max_positions} positions (--context-length)",
                "lower --context-length",
            )
            t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()

    def at(self, positions: torch.Tensor) -> RotaryAt:
        """The rotation of these positions, looked up once per forward for all layers."""
        self.reserve(self.max_positions, positions.device)
        # [num_tokens, 1, head_dim] each
        return RotaryAt(self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1))


@dataclass(frozen=True)
class RotaryAt:
    """RoPE's cos/sin rows for one batch's positions; applied to q and k in every layer."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads, head_dim], k: [num_tokens, kv_heads, head_dim]."""
        return _rotate(q, self.cos, self.sin), _rotate(k, self.cos, self.sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
