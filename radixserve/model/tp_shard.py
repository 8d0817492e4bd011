"""Which part of each weight a tensor-parallel rank holds (Megatron-style).

    column-parallel (split output rows)   q_proj, k_proj, v_proj, gate_proj, up_proj
    row-parallel (split input columns)    o_proj, down_proj: partial sums, one all-reduce each;
                                          their bias is added once (rank 0 keeps it, the
                                          others hold zeros)
    vocab-parallel (split vocab rows)     embed_tokens (masked lookup + all-reduce), lm_head
                                          (local logits + all-gather)
    replicated                            norms, q_norm / k_norm; MoE routers, experts and
                                          shared experts are read whole: the model keeps
                                          its rank's experts (model/moe_weights.py)

Query heads split evenly. KV heads split evenly when there are at least as many as ranks;
with fewer, each KV head is replicated on tp / num_kv_heads consecutive ranks (as vLLM does),
so rank r holds KV head r // (tp / num_kv_heads), the one its query heads read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from radixserve.config import ModelConfig

_COLUMN = ("gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `size`: its heads, MLP columns and vocab rows of `config`."""

    config: ModelConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        check_tp_size(self.config, self.size)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        kv = self.config.num_kv_heads
        if kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size // self.size

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_size

    def local_config(self) -> ModelConfig:
        """The config as this rank sees its shard (KV pool and attention shapes)."""
        return dataclasses.replace(
            self.config,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
        )

    def hf_index(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's part of an HF tensor; None: the whole tensor."""
        if self.size == 1 or ".experts." in hf_name or ".shared_expert." in hf_name:
            return None
        kind = hf_name.rsplit(".", 2)[-2]
        hd = self.config.head_dim
        if kind == "q_proj":
            return 0, self.rank * self.num_heads * hd, (self.rank + 1) * self.num_heads * hd
        if kind in ("k_proj", "v_proj"):
            start = self.kv_head_start * hd
            return 0, start, start + self.num_kv_heads * hd
        if kind in _COLUMN:
            n = self.intermediate_size
            return 0, self.rank * n, (self.rank + 1) * n
        if kind in _VOCAB:
            return 0, self.vocab_start, self.vocab_start + self.vocab_size
        if kind in _ROW and hf_name.endswith(".weight"):
            n = self.num_heads * hd if kind == "o_proj" else self.intermediate_size
            return 1, self.rank * n, (self.rank + 1) * n
        return None

    def zeroed(self, hf_name: str) -> bool:
        """A row-parallel bias on ranks > 0: summed by the all-reduce, it must count once."""
        kind = hf_name.rsplit(".", 2)[-2]
        return self.rank > 0 and kind in _ROW and hf_name.endswith(".bias")

    def select(self, hf_name: str, tensor) -> torch.Tensor:
        """This rank's part of `tensor` (a torch tensor or a lazy safetensors slice, from
        which only that part is read)."""
        index = self.hf_index(hf_name)
        if index is None:
            part = tensor[:]
        else:
            dim, start, stop = index
            part = tensor[start:stop] if dim == 0 else tensor[:, start:stop]
        return torch.zeros_like(part) if self.zeroed(hf_name) else part


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Raises unless `config`'s heads, KV heads, MLP and vocab split evenly over tp_size."""
    if tp_size == 1:
        return
    problems = []
    if config.num_heads % tp_size:
        problems.append(f"num_attention_heads={config.num_heads}")
    kv = config.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        problems.append(f"num_key_value_heads={kv}")
    if config.intermediate_size % tp_size:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if config.vocab_size % tp_size:  # padding the vocab to a multiple is not done yet
        problems.append(f"vocab_size={config.vocab_size}")
    if problems:
        raise ValueError(f"--tp-size {tp_size} does not divide the model's {', '.join(problems)}")
