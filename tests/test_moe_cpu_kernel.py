"""The C++ grouped-experts op (native/csrc/moe_experts.cpp, `CpuLayerOps.moe_grouped_experts`)
against the torch path of model/moe.py: the same routed MLP output, experts with no rows,
one row or many, input widths off the SIMD lanes, expert parallelism's local slice; and a
routed block whose layer ops are on takes it for decode-sized batches only. Listed in
tests/test_cpu_isa_paths.py's KERNEL_TESTS (its AVX2 and portable paths run too)."""

from __future__ import annotations

import pytest
import torch

from radixserve.config.model import MoEConfig
from radixserve.distributed.group import TPGroup
from radixserve.model import moe
from radixserve.model.cpu_layer_ops import CpuLayerOps
from radixserve.model.moe import SparseMoeBlock, grouped_experts, route


@pytest.fixture(scope="module")
def layer_ops(cpu_ops) -> CpuLayerOps:
    return CpuLayerOps(cpu_ops)


def _weights(gen, experts: int, inter: int, hidden: int):
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    return w13, torch.randn(experts, hidden, inter, generator=gen) / inter**0.5


@pytest.mark.parametrize(
    "tokens, experts, top_k, inter, hidden",
    [(1, 8, 2, 24, 40), (16, 128, 8, 48, 64), (40, 6, 3, 17, 33), (3, 4, 4, 32, 128)],
)
def test_one_call_equals_the_per_expert_matmuls(layer_ops, tokens, experts, top_k, inter, hidden):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    w13, w2 = _weights(gen, experts, inter, hidden)
    routing = route(torch.randn(tokens, experts, generator=gen), top_k, norm_topk_prob=True)
    reference = grouped_experts(x, w13, w2, routing)
    fused = grouped_experts(x, w13, w2, routing, fused=layer_ops.moe_grouped_experts)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    half = experts // 2  # expert parallelism: the upper half's rank
    local = grouped_experts(x, w13[half:], w2[half:], routing, first_expert=half)
    fused_local = grouped_experts(
        x, w13[half:], w2[half:], routing, first_expert=half, fused=layer_ops.moe_grouped_experts
    )
    torch.testing.assert_close(fused_local, local, atol=1e-5, rtol=1e-5)


def test_bad_arguments_raise(layer_ops):
    rows, w13, w2 = torch.zeros(3, 8), torch.zeros(2, 8, 8), torch.zeros(2, 8, 4)
    with pytest.raises(RuntimeError, match="offsets span 0..n"):
        layer_ops.moe_grouped_experts(rows, torch.tensor([0, 1, 2]), w13, w2)
    with pytest.raises(RuntimeError, match="float32"):
        layer_ops.moe_grouped_experts(rows.bfloat16(), torch.tensor([0, 1, 3]), w13, w2)


def test_block_uses_the_call_for_decode_rows_only(layer_ops, monkeypatch):
    """A routed block with the layer ops on: decode-sized batches go through the one call,
    prefill-sized ones (over FUSED_MAX_ROWS routed rows) through torch's matmuls; both give
    the block's output without the ops."""
    block = SparseMoeBlock(32, MoEConfig(8, 2, 16, True, (0,)), TPGroup.single())
    gen = torch.Generator().manual_seed(0)
    for param in block.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.2
    calls = []
    counted = CpuLayerOps.moe_grouped_experts

    def count(self, *args):
        calls.append(args[0].shape[0])
        return counted(self, *args)

    monkeypatch.setattr(CpuLayerOps, "moe_grouped_experts", count)
    for tokens in (4, moe.FUSED_MAX_ROWS):  # 8 and 2 * FUSED_MAX_ROWS routed rows
        x = torch.randn(tokens, 32, generator=gen)
        with torch.inference_mode():
            block.ops = None
            reference = block(x)
            block.ops = layer_ops
            torch.testing.assert_close(block(x), reference, atol=1e-5, rtol=1e-5)
    assert calls == [8]
