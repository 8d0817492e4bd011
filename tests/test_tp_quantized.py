"""Quantized layers under tensor parallelism: each rank quantizes its own shard as its slice
of the whole layer would be at tp 1 (int8 / fp8 row scales over every rank's columns, int4
groups of the whole input), or cuts it from a GGUF's blocks or a GPTQ / AWQ checkpoint's
groups (output rows for column-parallel layers, whole blocks / groups of the input for
row-parallel ones), so greedy output over tp 2 equals one process."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from test_quantization_gguf import save_plain_llama, write_tiny_gguf
from test_quantization_gptq_awq import CASES, write_checkpoint
from torch import nn

from conftest import greedy_generate
from radixserve.config import CacheConfig, LoadConfig, ParallelConfig
from radixserve.distributed.group import TPGroup
from radixserve.model.loader import load_model
from radixserve.model.quant import QuantizationError
from radixserve.model.quant.fp8_linear import Fp8Linear
from radixserve.model.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from radixserve.model.quant.quantize import _quantize_row_shard
from radixserve.model.runner import ModelRunner
from radixserve.model.tp_runner import TPModelRunner

PROMPTS = [[(i * 37 + j * 11) % 250 + 3 for j in range(n)] for i, n in enumerate((19, 5, 33))]
LAYER_TYPES = {"int8": Int8WeightOnlyLinear, "int4": Int4WeightOnlyLinear}


@pytest.mark.parametrize(("method", "group_size"), [("int8", None), ("int4", 32)])
def test_quantized_tp2_matches_one_process(tiny_models, method, group_size):
    load = LoadConfig(
        model=str(tiny_models["llama"]),
        device="cpu",
        quantization=method,
        quantization_group_size=group_size,
    )
    cache = CacheConfig(page_size=16, max_total_tokens=1024)
    expected = greedy_generate(ModelRunner.create(load, cache), PROMPTS, 8)
    runner = TPModelRunner.create(load, cache, ParallelConfig(tp_size=2))
    try:
        down = runner.model.layers[0].mlp.down_proj
        assert isinstance(down, LAYER_TYPES[method])
        assert down.in_features == 64  # intermediate 128 over two ranks: packed, not fp
        assert greedy_generate(runner, PROMPTS, 8) == expected
    finally:
        runner.close()


@pytest.mark.parametrize("head", [None, "Q8_0"])  # tied fp head; an untied head of blocks
def test_gguf_blocks_sharded_over_tp2_match_one_process(tmp_path, head):
    from gguf import GGMLQuantizationType

    path = tmp_path / "tiny.gguf"
    head_type = None if head is None else GGMLQuantizationType[head]
    write_tiny_gguf(save_plain_llama(tmp_path / "hf"), path, head=head_type)
    load = LoadConfig(model=str(path), device="cpu", quantization="gguf", dtype="float32")
    cache = CacheConfig(page_size=16, max_total_tokens=1024)
    expected = greedy_generate(ModelRunner.create(load, cache), PROMPTS, 8)
    runner = TPModelRunner.create(load, cache, ParallelConfig(tp_size=2))
    try:
        o_proj = runner.model.layers[0].self_attn.o_proj  # Q4_1 in the file
        assert isinstance(o_proj, Int4WeightOnlyLinear)
        assert o_proj.in_features == 32  # whole blocks of its 64 inputs: one per rank
        assert greedy_generate(runner, PROMPTS, 8) == expected
    finally:
        runner.close()


@pytest.mark.parametrize("case", ["gptq-asym", "awq"])  # group 32; qwen2's q/k/v biases
def test_gptq_awq_groups_sharded_over_tp2_match_one_process(tiny_models, tmp_path, case):
    folder = tmp_path / case
    write_checkpoint(tiny_models[CASES[case][3]], folder, tmp_path / "twin", CASES[case])
    load = LoadConfig(model=str(folder), device="cpu", dtype="float32")
    cache = CacheConfig(page_size=16, max_total_tokens=1024)
    expected = greedy_generate(ModelRunner.create(load, cache), PROMPTS, 8)
    runner = TPModelRunner.create(load, cache, ParallelConfig(tp_size=2))
    try:
        layer = runner.model.layers[0]
        o_proj, qkv = layer.self_attn.o_proj, layer.self_attn.qkv_proj
        assert isinstance(o_proj, Int4WeightOnlyLinear) and o_proj.in_features == 32
        assert (qkv.out_features, qkv.in_features) == (64, 64)  # 2 of 4 heads, 1 of 2 KV heads
        assert greedy_generate(runner, PROMPTS, 8) == expected
    finally:
        runner.close()


def test_gptq_groups_that_would_straddle_ranks_are_refused_naming_tp_size(tiny_models, tmp_path):
    """gptq-sym has groups of 64; o_proj's 64 inputs over two ranks are 32 each."""
    folder = tmp_path / "gptq-sym"
    write_checkpoint(tiny_models["llama"], folder, tmp_path / "twin", CASES["gptq-sym"])
    message = "--tp-size 2: o_proj keeps 32 input columns"
    with pytest.raises(QuantizationError, match=message):
        load_model(LoadConfig(model=str(folder), device="cpu"), _TwoRanks(rank=0, size=2))
    explicit = LoadConfig(model=str(folder), device="cpu", quantization="gptq")
    with pytest.raises(QuantizationError, match=message):  # before any rank starts
        TPModelRunner.create(explicit, CacheConfig(), ParallelConfig(tp_size=2))


class _TwoRanks(TPGroup):
    """A stand-in for rank 0 of two: the group's max is this rank's own (no process)."""

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_int4_groups_that_would_straddle_ranks_are_refused_naming_the_flag():
    shard = nn.Linear(32, 16, bias=False)  # the whole layer: 64 inputs
    with pytest.raises(QuantizationError, match="--quantization-group-size"):
        grouped = LoadConfig(quantization_group_size=64)  # one group over both ranks
        _quantize_row_shard(shard, "int4", grouped, _TwoRanks(rank=0, size=2))
    fitting = _quantize_row_shard(shard, "int4", LoadConfig(), _TwoRanks(rank=0, size=2))
    assert fitting.group_size == 32  # the default


@dataclass(frozen=True)
class _WithOtherRank(TPGroup):
    """Rank 0 of two, the other rank's values given: the group's max is the max of both."""

    other: torch.Tensor | None = None

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(x, self.other)


def test_an_int8_row_shard_holds_its_slice_of_the_whole_layers_codes_and_scales():
    torch.manual_seed(0)
    whole = nn.Linear(64, 8, bias=False)
    left, right = whole.weight.detach()[:, :32], whole.weight.detach()[:, 32:]
    right[0] *= 10  # row 0's max lies in the other rank's columns
    expected = Int8WeightOnlyLinear.from_float(whole)
    shard = nn.Linear(32, 8, bias=False)
    shard.weight.data.copy_(left)
    group = _WithOtherRank(rank=0, size=2, other=right.abs().amax(dim=1))
    got = _quantize_row_shard(shard, "int8", LoadConfig(), group)
    torch.testing.assert_close(got.scales, expected.scales, rtol=0, atol=0)
    assert torch.equal(got.qweight, expected.qweight[:, :32])


def test_an_fp8_row_shard_holds_its_slice_of_the_whole_layers_codes_and_scales():
    torch.manual_seed(0)
    whole = nn.Linear(64, 8, bias=False)
    left, right = whole.weight.detach()[:, :32], whole.weight.detach()[:, 32:]
    right[1] *= 10
    expected = Fp8Linear.from_float(whole)
    shard = nn.Linear(32, 8, bias=False)
    shard.weight.data.copy_(left)
    group = _WithOtherRank(rank=0, size=2, other=right.abs().amax(dim=1))
    got = _quantize_row_shard(shard, "fp8", LoadConfig(), group)
    assert isinstance(got, Fp8Linear)
    torch.testing.assert_close(got.scales, expected.scales, rtol=0, atol=0)
    assert torch.equal(got.qweight.view(torch.uint8), expected.qweight[:, :32].view(torch.uint8))


@pytest.mark.slow
def test_the_default_models_q4_1_blocks_over_tp3_match_one_process():
    """SmolLM2-135M divides only by 3 (9 heads, 3 KV heads): o_proj's 192 inputs per rank
    are 6 whole Q4_1 blocks."""
    load = LoadConfig(model=None, device="cpu", quantization="gguf")
    cache = CacheConfig(page_size=16, max_total_tokens=1024)
    prompts = [[(i * 131 + j * 17) % 4000 + 200 for j in range(n)] for i, n in enumerate((9, 30))]
    expected = greedy_generate(ModelRunner.create(load, cache), prompts, 8)
    runner = TPModelRunner.create(load, cache, ParallelConfig(tp_size=3))
    try:
        assert isinstance(runner.model.layers[0].self_attn.o_proj, Int4WeightOnlyLinear)
        assert greedy_generate(runner, prompts, 8) == expected
    finally:
        runner.close()
