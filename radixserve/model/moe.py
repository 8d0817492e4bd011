"""The mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral): route, run experts grouped.

Routing is transformers' exactly: softmax over the router logits in fp32, top-k, the top-k
probabilities renormalized when `norm_topk_prob` (Mixtral always), cast to the activations'
dtype. The experts then run grouped, one matmul per expert over the rows routed to it:

    tokens x top_k assignments --sort by expert--> [e0 rows | e1 rows | ... ]   (gather)
    each expert's run of rows:  down(silu(gate(x)) * up(x))                     (2 matmuls)
    rows * routing weight --index_add by token--> out [num_tokens, hidden]      (scatter-add)

That path reads the per-expert row counts on the host, which a CUDA graph capture or a
torch.compile trace cannot; those run every expert over every row instead (`dense_experts`,
weights zero where a token was not routed): the same result, sync-free, for small batches.
On CUDA, fp experts run the Triton fused-MoE kernel instead (radixserve_kernels.fused_moe:
rows sorted by expert into padded blocks, each block one grouped matmul, no host read).
Qwen2-MoE adds a shared expert whose output is scaled by sigmoid(shared_expert_gate(x)).

Expert parallelism (`--ep-size N`, N = --tp-size): rank r holds experts [r * E/N, (r+1) * E/N)
and the whole router; every rank sees every token (attention's all-reduce replicated them),
routes all of them, runs only the rows routed to its experts, and one all-reduce sums the
ranks' parts. The shared expert is held whole and added by rank 0 alone, before that sum.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.config.model import ModelConfig, MoEConfig
from radixserve.distributed.group import TPGroup
from radixserve.model.cpu_layer_ops import CpuLayerOps
from radixserve.model.layers import GatedMLP
from radixserve.model.quant.base_linear import dense_linear


class Routing(NamedTuple):
    """Each token's experts and their weights (activation dtype): [num_tokens, top_k] each."""

    weights: torch.Tensor
    experts: torch.Tensor


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """[num_tokens, num_experts] logits -> the top-k experts of each token, as transformers."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.to(router_logits.dtype), experts)


def grouped_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [local_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [local_experts, hidden, inter]
    routing: Routing,
    silu_mul=None,
    first_expert: int = 0,
    fused: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sum over each token's experts among the local ones (`first_expert` onwards, as many as
    `w13` holds) of weight * expert(x): rows sorted by expert, one gate_up and one down
    matmul per expert that received rows; or, `fused` (CpuLayerOps.moe_grouped_experts) on
    fp32 rows, up to FUSED_MAX_ROWS of them, every expert's rows in that one C++ call."""
    grouped = group_rows(x, routing, w13.shape[0], first_expert)
    if fused is not None and x.dtype == torch.float32 and len(grouped.order) <= FUSED_MAX_ROWS:
        offsets = torch.tensor([0, *itertools.accumulate(grouped.counts)], dtype=torch.int64)
        out_rows = fused(grouped.rows.contiguous(), offsets, w13, w2)
        return scatter_rows(x, routing, grouped, out_rows)

    def run(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return _expert(rows, w13[expert], w2[expert], silu_mul)

    return scatter_rows(x, routing, grouped, _run_groups(grouped, run))


FUSED_MAX_ROWS = 256
"""Routed rows up to which the C++ call runs fp32 experts (decode); from there on, torch's
matmuls, whose blocked kernels beat its one dot per output once an expert has many rows."""


class GroupedRows(NamedTuple):
    """The (token, expert) rows routed to local experts, sorted by expert."""

    rows: torch.Tensor  # [num_rows, hidden]: the tokens' activations, expert by expert
    order: torch.Tensor  # [num_rows]: each row's index into the flat [tokens * top_k] routing
    counts: list[int]  # rows of each local expert


def group_rows(
    x: torch.Tensor, routing: Routing, num_local: int, first_expert: int = 0
) -> GroupedRows:
    """Sorts the rows routed to local experts [first_expert, first_expert + num_local) by
    expert (one host read: the per-expert counts)."""
    flat = routing.experts.reshape(-1) - first_expert  # [num_tokens * top_k], local ids
    flat = torch.where((flat >= 0) & (flat < num_local), flat, num_local)  # others sort last
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_local)[:num_local].tolist()
    order = order[: sum(counts)]  # the rows routed to local experts, grouped
    return GroupedRows(x[order // routing.experts.shape[1]], order, counts)


def scatter_rows(
    x: torch.Tensor, routing: Routing, grouped: GroupedRows, out_rows: torch.Tensor
) -> torch.Tensor:
    """Each token's sum of its rows' expert outputs, weighted by the routing."""
    out_rows = out_rows * routing.weights.reshape(-1)[grouped.order].unsqueeze(-1)
    token_of_row = grouped.order // routing.experts.shape[1]
    return torch.zeros_like(x).index_add_(0, token_of_row, out_rows)


def _run_groups(grouped: GroupedRows, run: Callable[[int, torch.Tensor], torch.Tensor]):
    out_rows = torch.empty_like(grouped.rows)
    start = 0
    for expert, count in enumerate(grouped.counts):
        if count:
            end = start + count
            out_rows[start:end] = run(expert, grouped.rows[start:end])
            start = end
    return out_rows


def grouped_rows(
    x: torch.Tensor,
    routing: Routing,
    num_local: int,
    run: Callable[[int, torch.Tensor], torch.Tensor],
    first_expert: int = 0,
) -> torch.Tensor:
    """`grouped_experts` for any expert: `run(e, rows)` is local expert e on its rows (e.g.
    through quantized layers)."""
    grouped = group_rows(x, routing, num_local, first_expert)
    return scatter_rows(x, routing, grouped, _run_groups(grouped, run))


def dense_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    num_experts: int,
    first_expert: int = 0,
) -> torch.Tensor:
    """`grouped_experts` without host syncs (graph capture, tracing): every local expert over
    every row, each output weighted by the token's weight for it (zero if not routed)."""
    full = torch.zeros(x.shape[0], num_experts, dtype=x.dtype, device=x.device)
    full.scatter_(1, routing.experts, routing.weights)  # [num_tokens, num_experts]
    full = full[:, first_expert : first_expert + w13.shape[0]]
    gate_up = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))  # [experts, tokens, 2 * inter]
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2))  # [experts, tokens, hidden]
    return (out * full.t().unsqueeze(-1)).sum(dim=0)


def dense_rows(
    x: torch.Tensor,
    routing: Routing,
    num_experts: int,
    num_local: int,
    run: Callable[[int, torch.Tensor], torch.Tensor],
    first_expert: int = 0,
) -> torch.Tensor:
    """`dense_experts` for any expert `run(e, rows)`: each local expert over every row."""
    full = torch.zeros(x.shape[0], num_experts, dtype=x.dtype, device=x.device)
    full.scatter_(1, routing.experts, routing.weights)
    out = torch.zeros_like(x)
    for e in range(num_local):
        out += full[:, first_expert + e, None] * run(e, x)
    return out


def _expert(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, silu_mul) -> torch.Tensor:
    gate_up = rows @ w13.t()
    if silu_mul is not None:
        return silu_mul(gate_up) @ w2.t()
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


@functools.cache
def _triton_fused_moe() -> Callable[..., torch.Tensor] | None:
    """radixserve_kernels.fused_moe (sync-free: also inside a CUDA graph capture), or None
    where Triton does not import (torch's grouped matmuls then)."""
    try:
        from radixserve_kernels.fused_moe import fused_moe
    except ImportError:
        return None
    return fused_moe


def _cannot_sync(x: torch.Tensor) -> bool:
    """Inside a CUDA graph capture or a torch.compile trace (no host reads allowed)."""
    if torch.compiler.is_compiling():
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def check_ep_size(config: ModelConfig, tp_size: int, ep_size: int) -> None:
    """Raises, naming the flag, unless a MoE model's experts split evenly over `ep_size`
    ranks and, under tensor parallelism, `ep_size` is the TP size (no column split yet)."""
    if config.moe is None:
        return
    if tp_size > 1 and ep_size != tp_size:
        raise ValueError(
            f"{config.architecture} under --tp-size {tp_size} needs --ep-size {tp_size} "
            f"(its experts are split by expert over the ranks); got --ep-size {ep_size}"
        )
    if config.moe.num_experts % ep_size:
        raise ValueError(
            f"--ep-size {ep_size} does not divide the model's {config.moe.num_experts} experts"
        )


class SparseMoeBlock(nn.Module):
    """A routed MLP: `gate` (the router), this rank's experts stacked as `w13` / `w2` (or,
    quantized, one gate_up and one down layer each: `use_expert_layers`), and Qwen2-MoE's
    optional shared expert (held whole, run by rank 0)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TPGroup):
        super().__init__()
        if moe.num_experts % tp.size:
            raise ValueError(f"--ep-size {tp.size} does not divide {moe.num_experts} experts")
        self.moe, self.tp = moe, tp
        local, inter = moe.num_experts // tp.size, moe.intermediate_size
        self.first_expert = tp.rank * local
        self.gate = nn.Parameter(torch.empty(moe.num_experts, hidden_size))  # the router
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, inter))
        if moe.shared_expert_intermediate_size:
            shared = moe.shared_expert_intermediate_size
            self.shared_expert = GatedMLP(hidden_size, shared, False, TPGroup.single())
            self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden_size))
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.ops: CpuLayerOps | None = None
        self.gate_up_layers: nn.ModuleList | None = None
        self.down_layers: nn.ModuleList | None = None

    def use_expert_layers(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        """Runs local expert e as down[e](silu(gate) * up of gate_up[e](x)): layers of any
        format (GGUF blocks, int8 / int4) in place of the stacked fp `w13` / `w2`, dropped."""
        if len(gate_up) != self.w13.shape[0] or len(down) != len(gate_up):
            raise ValueError(f"expected {self.w13.shape[0]} gate_up and down layers")
        self.gate_up_layers, self.down_layers = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.num_local = len(gate_up)
        self.w13 = self.w2 = None

    def quantize_experts(self, make: Callable[[nn.Module], nn.Module]) -> None:
        """Each local expert's gate_up and down as `make(dense layer)` (int8 / int4 on load);
        the shared expert's projections too."""
        gate_up = [make(dense_linear(w)) for w in self.w13.detach()]
        self.use_expert_layers(gate_up, [make(dense_linear(w)) for w in self.w2.detach()])
        if self.shared_expert is not None:
            shared = self.shared_expert
            shared.gate_up_proj, shared.down_proj = (
                make(shared.gate_up_proj),
                make(shared.down_proj),
            )

    def _run_layers(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_layers[expert](rows)
        if self.ops is not None and not torch.compiler.is_compiling():
            return self.down_layers[expert](self.ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_layers[expert](F.silu(gate) * up)

    def forward(self, x: torch.Tensor, lora: object | None = None) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]. `lora` is the dense MLP's argument:
        always None here (--enable-lora refuses MoE models at start)."""
        routing = route(F.linear(x, self.gate), self.moe.top_k, self.moe.norm_topk_prob)
        first, num_experts = self.first_expert, self.moe.num_experts
        if self.gate_up_layers is not None and _cannot_sync(x):
            out = dense_rows(x, routing, num_experts, self.num_local, self._run_layers, first)
        elif self.gate_up_layers is not None:
            out = grouped_rows(x, routing, self.num_local, self._run_layers, first)
        elif x.is_cuda and (kernel := _triton_fused_moe()) is not None:
            out = kernel(x, self.w13, self.w2, routing.weights, routing.experts, first)
        elif _cannot_sync(x):
            out = dense_experts(x, self.w13, self.w2, routing, num_experts, first)
        else:
            silu_mul = None if self.ops is None else self.ops.silu_mul
            fused = None if self.ops is None else self.ops.moe_grouped_experts
            out = grouped_experts(x, self.w13, self.w2, routing, silu_mul, first, fused)
        if self.shared_expert is not None and self.tp.rank == 0:
            shared_gate = torch.sigmoid(F.linear(x, self.shared_expert_gate))
            out = out + shared_gate * self.shared_expert(x)
        return self.tp.all_reduce(out)
