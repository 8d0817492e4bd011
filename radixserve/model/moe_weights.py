"""HF checkpoint names of mixture-of-experts MLPs -> the stacked parameters of SparseMoeBlock.

    HF tensor (per layer i, expert e)                         ours
    mlp.gate.weight                     [E, hidden]           mlp.gate
    mlp.experts.e.gate_proj.weight      [inter, hidden]       mlp.w13[e, :inter]
    mlp.experts.e.up_proj.weight        [inter, hidden]       mlp.w13[e, inter:]
    mlp.experts.e.down_proj.weight      [hidden, inter]       mlp.w2[e]
    mlp.shared_expert.{gate,up,down}_proj.weight              mlp.shared_expert (a GatedMLP)
    mlp.shared_expert_gate.weight       [1, hidden]           mlp.shared_expert_gate

Mixtral's `block_sparse_moe.experts.e.{w1,w3,w2}` are the same gate / up / down tensors.
Under expert parallelism a rank keeps its own experts' tensors (at local index e - first)
and skips the others' (`SKIP`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from radixserve.config import ModelConfig
from radixserve.model.tp_shard import ShardLayout

RowSelector = Callable[..., object]  # model -> the index of the parameter the tensor fills
SKIP = ("", None)  # another expert-parallel rank's expert: not loaded here

_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_SHARED = re.compile(r"layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj)\.weight")


def canonical_moe_name(name: str) -> str:
    """Mixtral's names in Qwen-MoE's spelling (`block_sparse_moe` -> `mlp`, w1/w3/w2)."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"\.experts\.(\d+)\.(w[123])\.", _mixtral_proj, name)


def _mixtral_proj(match: re.Match) -> str:
    return f".experts.{match[1]}.{_MIXTRAL_PROJ[match[2]]}."


def map_moe_name(name: str, layout: ShardLayout) -> tuple[str, RowSelector | None] | None:
    """An MoE tensor's (parameter name, row selector), `SKIP` for another rank's expert;
    None: not an MoE tensor."""
    config = layout.config
    name = canonical_moe_name(name)
    for router in ("gate", "shared_expert_gate"):
        if name.endswith(f".mlp.{router}.weight"):
            return name.removesuffix(".weight"), None
    inter = config.moe.intermediate_size if config.moe else 0
    if match := _EXPERT.fullmatch(name):
        layer, proj = int(match[1]), match[3]
        expert = int(match[2]) - layout.rank * _local_experts(layout)
        if not 0 <= expert < _local_experts(layout):
            return SKIP
        if proj == "down_proj":
            return f"layers.{layer}.mlp.w2", lambda model: expert
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, None)
        return f"layers.{layer}.mlp.w13", lambda model: (expert, rows)
    if match := _SHARED.fullmatch(name):
        layer, proj = int(match[1]), match[2]
        half = config.moe.shared_expert_intermediate_size
        rows = slice(0, half) if proj == "gate_proj" else slice(half, None)
        return f"layers.{layer}.mlp.shared_expert.gate_up_proj.weight", lambda model: rows
    return None


def _local_experts(layout: ShardLayout) -> int:
    return layout.config.moe.num_experts // layout.size


def moe_num_parts(param_name: str, layout: ShardLayout) -> int | None:
    """How many HF tensors fill an MoE parameter of this rank; None: not one."""
    if layout.config.moe is None:
        return None
    if param_name.endswith(".mlp.w13"):
        return 2 * _local_experts(layout)
    if param_name.endswith(".mlp.w2"):
        return _local_experts(layout)
    return None


def moe_mlp_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A sparse layer's MLP tensors, HF-named (relative to the layer), with their shapes."""
    moe, hidden = config.moe, config.hidden_size
    mixtral = config.architecture == "MixtralForCausalLM"
    prefix = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    inter = moe.intermediate_size
    shapes = {f"{prefix}.gate.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        shapes[f"{prefix}.experts.{e}.{names[0]}.weight"] = (inter, hidden)
        shapes[f"{prefix}.experts.{e}.{names[1]}.weight"] = (inter, hidden)
        shapes[f"{prefix}.experts.{e}.{names[2]}.weight"] = (hidden, inter)
    shared = moe.shared_expert_intermediate_size
    if shared:
        shapes["mlp.shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes["mlp.shared_expert.up_proj.weight"] = (shared, hidden)
        shapes["mlp.shared_expert.down_proj.weight"] = (hidden, shared)
        shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes
