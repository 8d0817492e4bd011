"""EAGLE-3 draft head in SGLang's layout (SpecForge output), on plain tensors, no KV pool.

    target aux hidden states (3 layers) --fc--> fused [hidden]     (once per target position)
    midlayer: qkv over cat(input_layernorm(embed(next token)), hidden_norm(fused))  (2x hidden)
              -> attention -> post_attention_layernorm (+ fused as residual) -> MLP
    norm(mlp, residual) -> (to the head's lm_head over draft_vocab_size, pre-norm sum -> next
    draft step's hidden state); draft id i means target id i + d2t[i].

Attention runs with torch SDPA over K/V the caller passes in (engine/speculative/eagle.py
keeps each request's, capped at a window); `forward` returns it with the new columns' K/V.
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
from radixserve.distributed.group import TPGroup
from radixserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding

FLAG = "speculative_draft_model_path"

# HF name -> (our parameter, which third / half of it: q, k, v of qkv_proj; gate, up)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


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


@dataclass
class HeadStep:
    """One forward of the head over new columns: fp32 logits over the target vocabulary at
    the last one [B, vocab], the pre-norm hidden states [B, T, hidden] and the K/V so far."""

    logits: torch.Tensor
    hidden: torch.Tensor
    keys: torch.Tensor  # [B, kv_heads, T_all, head_dim]
    values: torch.Tensor


class Eagle3Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(2 * config.hidden_size, qkv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x, rotary, cache, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, 2 * hidden]; cache: (keys, values) of earlier columns or None; mask
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


class Eagle3DecoderLayer(nn.Module):
    """SGLang's `midlayer`: the token's embedding and the fused hidden state, normed apart,
    concatenated into one 2x-hidden QKV input; the fused hidden state is the residual."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Eagle3Attention(config)
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

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, 3 * target hidden] captured aux hidden states -> [n, hidden]."""
        return self.fc(aux.to(self.fc.weight.dtype))

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
        draft = (normed @ self.lm_head.weight.t()).float()  # [B, draft_vocab]
        full = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.hot_ids, draft)


def load_eagle3_head(path: str, target, device: torch.device, dtype: torch.dtype) -> Eagle3Head:
    """The head in folder `path` (config.json + *.safetensors) for the target model (an
    LlamaForCausalLM); refused, naming the flag, where its shapes do not fit the target."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{FLAG}: {path} has no config.json (an EAGLE-3 head folder)")
    cfg = json.loads((folder / "config.json").read_text())
    config = _head_config(cfg)
    tensors = _read_tensors(folder)
    target_hidden = target.config.hidden_size
    fc = tensors.get("fc.weight")
    if fc is None or fc.shape[1] != 3 * target_hidden:
        got = None if fc is None else fc.shape[1] // 3
        raise ValueError(
            f"{FLAG}: the EAGLE-3 head reads hidden states of size {got}, "
            f"the target's are {target_hidden}"
        )
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    draft_vocab = cfg.get("draft_vocab_size") or target.config.vocab_size
    head = Eagle3Head(config, target_hidden, draft_vocab, target)
    if "embed_tokens.weight" in tensors:
        head.embed_tokens = nn.Embedding(*tensors["embed_tokens.weight"].shape)
    elif config.hidden_size != target_hidden:
        raise ValueError(f"{FLAG}: a head without embeddings must have the target's hidden size")
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = _target_head_weight(target, draft_vocab)
    _copy_weights(head, tensors)
    if d2t is not None:
        head.hot_ids = d2t.long() + torch.arange(len(d2t))
    _check_vocab(head.hot_ids, draft_vocab, target.config.vocab_size)
    return head.to(device=device, dtype=dtype).eval()


def _head_config(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{FLAG}: EAGLE-3 heads of one layer are supported; got {cfg['num_hidden_layers']}"
        )
    return ModelConfig.from_hf_dict(cfg | {"architectures": ["LlamaForCausalLM"]})


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{FLAG}: {folder} has no *.safetensors weights")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors


def _target_head_weight(target, draft_vocab: int) -> torch.Tensor:
    """A head without `lm_head` uses the target's (tied: its embedding)."""
    if draft_vocab != target.config.vocab_size:
        raise ValueError(f"{FLAG}: a head without lm_head must have the target's vocabulary")
    if target.lm_head is None:
        return target.embed_tokens.weight.detach()
    return target.lm_head.dequantize().detach()  # a quantized target's head, as floats


def _copy_weights(head: Eagle3Head, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(head.named_parameters())
    filled = dict.fromkeys(params, 0)
    for name, tensor in tensors.items():
        dest_name, part = _our_name(name)
        if dest_name not in params:
            raise ValueError(f"{FLAG}: checkpoint tensor {name!r} has no place in an EAGLE-3 head")
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
        raise ValueError(f"{FLAG}: the EAGLE-3 head is missing {', '.join(missing)}")


def _our_name(name: str) -> tuple[str, int | None]:
    for hf_part, (ours, part) in _FUSED.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, ours), part
    return name, None


def _part_of(head: Eagle3Head, param: torch.Tensor, name: str, part: int | None) -> torch.Tensor:
    if part is None:
        return param
    if "qkv_proj" in name:
        attn = head.midlayer.self_attn
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        return param.split(sizes)[part]
    return param.chunk(2)[part]


def _check_vocab(hot_ids: torch.Tensor, draft_vocab: int, vocab: int) -> None:
    if len(hot_ids) != draft_vocab or int(hot_ids.min()) < 0 or int(hot_ids.max()) >= vocab:
        raise ValueError(
            f"{FLAG}: the head's d2t must map its {draft_vocab} draft ids into the target's "
            f"{vocab} token ids"
        )
