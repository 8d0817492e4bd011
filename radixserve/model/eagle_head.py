"""What EAGLE draft heads share (model/eagle3.py: EAGLE-3, model/eagle1.py: EAGLE-1/2): the
step interface the drafter (engine/speculative/eagle.py) runs, the attention over K/V the
caller keeps, and reading a head folder (config.json + safetensors) into fused parameters.

    head.aux_layers       what the target's runner captures for it (model/runner.py)
    head.fuse(aux)        captured rows [n, captured width] -> [n, hidden] (once per position)
    head(hidden, tokens, positions, cache, mask)  one step over new columns -> HeadStep
    pack_for_cpu(head)    serving on CPU in fp32: its linears on the packed dense kernel
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from radixserve.config import ModelConfig
from radixserve.model.quant.batch_invariant import BatchInvariantLinear, dense_kernels

FLAG = "speculative_draft_model_path"

# HF name -> (our parameter, which third / half of it: q, k, v of qkv_proj; gate, up)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


@dataclass
class HeadStep:
    """One forward of a head over new columns: fp32 logits over the target vocabulary at
    the last one [B, vocab] (every one: [B, T, vocab]), the hidden states the next step
    reads [B, T, hidden] and the K/V so far."""

    logits: torch.Tensor
    hidden: torch.Tensor
    keys: torch.Tensor  # [B, kv_heads, T_all, head_dim]
    values: torch.Tensor


def linear_weight(linear: nn.Module) -> torch.Tensor:
    """The tensor holding a head linear's weight, packed or not (its dtype and device)."""
    return linear.packed_weight if isinstance(linear, BatchInvariantLinear) else linear.weight


def pack_for_cpu(head: nn.Module) -> int:
    """A head served on CPU in fp32: its nn.Linear layers become BatchInvariantLinear (the
    packed dense kernel, native/csrc/dense_matmul.cpp). Between draft steps the target's
    weights push the head's out of cache, and for one row from memory that kernel reads
    them about twice as fast as torch's matmul (docs/performance.md). Draft rounding never
    reaches an output: the target verifies every token. Returns how many were swapped
    (none off CPU, in another dtype or without the extension); training keeps nn.Linear."""
    linears = [
        (owner, name, child)
        for owner in head.modules()
        for name, child in owner.named_children()
        if isinstance(child, nn.Linear)
    ]
    cpu_fp32 = all(c.weight.device.type == "cpu" and c.weight.dtype == torch.float32
                   for _, _, c in linears)  # fmt: skip
    if not linears or not cpu_fp32 or dense_kernels() is None:
        return 0
    for owner, name, child in linears:
        setattr(owner, name, BatchInvariantLinear.from_linear(child))
    return len(linears)


class EagleAttention(nn.Module):
    """Llama attention with torch SDPA over K/V the caller passes in; the QKV input is
    `input_size` wide (EAGLE-3: 2x hidden, EAGLE-1: hidden)."""

    def __init__(self, config: ModelConfig, input_size: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(input_size, qkv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x, rotary, cache, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, input_size]; cache: (keys, values) of earlier columns or None; mask
        [B, 1, T, T_all] (True: attend). Returns (output [B, T, hidden], keys, values)."""
        batch, num_new = x.shape[:2]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(batch * num_new, self.num_heads, self.head_dim)
        k = k.reshape(batch * num_new, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, k)
        q = q.view(batch, num_new, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(batch, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        groups = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), mask
        )  # [B, heads, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, self.q_size)), k, v


def read_head_folder(path: str, what: str) -> tuple[dict[str, Any], ModelConfig, dict]:
    """(config.json, its one-layer Llama ModelConfig, every tensor without a `model.` prefix)
    of the head folder `path`; `what` names the head kind in the errors."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{FLAG}: {path} has no config.json (an {what} head folder)")
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{FLAG}: {what} heads of one layer are supported; got {cfg['num_hidden_layers']}"
        )
    config = ModelConfig.from_hf_dict(cfg | {"architectures": ["LlamaForCausalLM"]})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{FLAG}: {folder} has no *.safetensors weights")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return cfg, config, tensors


def check_reads(fc: torch.Tensor | None, parts: int, target_hidden: int, what: str) -> None:
    """The head's fc must read `parts` x the target's hidden size (names the flag)."""
    if fc is None or fc.dim() != 2 or fc.shape[1] != parts * target_hidden:
        got = None if fc is None or fc.dim() != 2 else fc.shape[1] // parts
        raise ValueError(
            f"{FLAG}: the {what} head reads hidden states of size {got}, "
            f"the target's are {target_hidden}"
        )


def copy_weights(head: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Copies HF-named tensors into the head's (fused) parameters; refuses unknown, missing
    or misshapen ones, naming the flag."""
    params = dict(head.named_parameters())
    filled = dict.fromkeys(params, 0)
    for name, tensor in tensors.items():
        dest_name, part = _our_name(name)
        if dest_name not in params:
            raise ValueError(f"{FLAG}: checkpoint tensor {name!r} has no place in an {what} head")
        dest = _part_of(head, params[dest_name].data, dest_name, part)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"{FLAG}: checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        filled[dest_name] += 1
    needed = {n: 3 if "qkv_proj" in n else 2 if "gate_up" in n else 1 for n in params}
    missing = sorted(n for n in params if filled[n] < needed[n])
    if missing:
        raise ValueError(f"{FLAG}: the {what} head is missing {', '.join(missing)}")


def _our_name(name: str) -> tuple[str, int | None]:
    for hf_part, (ours, part) in _FUSED.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, ours), part
    return name, None


def _part_of(head: nn.Module, param: torch.Tensor, name: str, part: int | None) -> torch.Tensor:
    if part is None:
        return param
    if "qkv_proj" in name:
        attn = head.get_submodule(name.split(".qkv_proj")[0])
        return param.split([attn.q_size, attn.kv_size, attn.kv_size])[part]
    return param.chunk(2)[part]
