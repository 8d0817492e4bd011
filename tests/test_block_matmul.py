"""The C++ block matmuls (backend "blocks"): against the dequantized fp32 matmul, row by row
the same whatever the number of rows, and through the GGUF loader the same greedy tokens as
torch's int kernels."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import assert_same_bits_on_one_and_two_threads, assert_within_fp32_rounding
from test_quantization_gguf import PROMPT, save_plain_llama, write_tiny_gguf

from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.quant.block_embedding import BlockEmbedding
from radixserve.model.quant.block_matmul import (
    int4_block_matmul,
    int8_block_matmul,
    pack_int4_blocks,
    resolve_cpu_quant_kernel,
    unpack_int4_blocks,
)
from radixserve.model.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from radixserve.model.runner import ModelRunner

SHAPES = [(576, 37), (1536, 5), (64, 129)]  # (K, N): the default model's K, odd N
ROWS = range(1, 10)


def _int4_weights(k: int, n: int, seed: int):
    """Codes, scales and mins of both signs; the fp32 weight q * d + m they stand for."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale_min = torch.randn(n, k // 32, 2, generator=gen) * 0.05
    weight = codes.view(n, k // 32, 32) * scale_min[..., :1] + scale_min[..., 1:]
    return pack_int4_blocks(codes), scale_min, weight.reshape(n, k)


def _int8_weights(k: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qs = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.randn(n, k // 32, generator=gen) * 0.01
    return qs, scales, (qs.view(n, k // 32, 32) * scales[..., None]).reshape(n, k)


def _check(matmul, weight: torch.Tensor, k: int) -> None:
    """Every row count of ROWS, fp32 and bf16 inputs, against the float64 x @ weight.T (error
    bound: fp32 summation of K terms, plus the output's rounding to bf16); and row i of every
    call bitwise equal to the one-row call on it."""
    x = torch.randn(max(ROWS), k)
    for dtype, out_eps in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-8)):
        xs = x.to(dtype)
        alone = torch.cat([matmul(xs[i : i + 1]) for i in range(len(xs))])
        assert alone.dtype == dtype
        expected = xs.double() @ weight.double().t()
        magnitude = xs.double().abs() @ weight.double().abs().t()
        bound = magnitude * k * 2.0**-24 + expected.abs() * out_eps
        assert ((alone.double() - expected).abs() <= bound).all(), dtype
        for m in ROWS:
            assert torch.equal(matmul(xs[:m]), alone[:m]), (dtype, m)


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_int4_blocks_equal_the_dequantized_matmul_and_each_row_its_one_row_call(cpu_ops, k, n):
    qs, scale_min, weight = _int4_weights(k, n, seed=k + n)
    _check(lambda x: int4_block_matmul(x, qs, scale_min), weight, k)


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_int8_blocks_equal_the_dequantized_matmul_and_each_row_its_one_row_call(cpu_ops, k, n):
    qs, scales, weight = _int8_weights(k, n, seed=k + n)
    _check(lambda x: int8_block_matmul(x, qs, scales), weight, k)


def test_output_rows_split_over_threads_give_the_same_bits(cpu_ops):
    qs, scale_min, _ = _int4_weights(576, 301, seed=3)
    x = torch.randn(5, 576)
    assert_same_bits_on_one_and_two_threads(lambda: int4_block_matmul(x, qs, scale_min))


def test_gguf_nibble_order_round_trips():
    codes = torch.randint(0, 16, (3, 64))
    qs = pack_int4_blocks(codes)
    assert qs[0, 0] == codes[0, 0] | (codes[0, 16] << 4)  # byte j: element j | j + 16
    assert torch.equal(unpack_int4_blocks(qs), codes.to(torch.uint8))


def test_block_layers_match_torch_layers_and_dequantize_past_dequant_min_rows(cpu_ops):
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (48, 96))
    scales, zeros = torch.rand(48, 3) * 0.1, torch.randn(48, 3) * 0.1
    torch_int4 = Int4WeightOnlyLinear(codes, scales, zeros, 32, backend="torch")
    blocks_int4 = Int4WeightOnlyLinear(codes, scales, zeros, 32, backend="blocks")
    q8 = torch.randint(-127, 128, (48, 96), dtype=torch.int8)
    torch_int8 = Int8WeightOnlyLinear(q8, scales, group_size=32, backend="torch")
    blocks_int8 = Int8WeightOnlyLinear(q8, scales, group_size=32, backend="blocks")
    for ours, theirs in ((blocks_int4, torch_int4), (blocks_int8, torch_int8)):
        assert ours.compute_dtype is None  # fp32 arithmetic on the input's dtype
        torch.testing.assert_close(ours.dequantize(torch.float32), theirs.dequantize(torch.float32))
        for m in (1, 5, ours.dequant_min_rows + 1):  # the last: dequantize + one matmul
            x = torch.randn(m, 96)
            assert_within_fp32_rounding(ours(x), x, theirs.dequantize(torch.float32))


def test_blocks_need_32_wide_groups():
    with pytest.raises(ValueError, match="backend 'blocks' needs group_size 32; got 64"):
        Int4WeightOnlyLinear(torch.zeros(16, 64, dtype=torch.int32), *[torch.ones(16, 1)] * 2,
                             64, backend="blocks")  # fmt: skip
    with pytest.raises(ValueError, match="--cpu-quant-kernel must be one of"):
        resolve_cpu_quant_kernel("fast")


def test_without_the_block_kernels_auto_keeps_torchs_and_blocks_says_why(monkeypatch):
    from radixserve.model.quant import block_matmul

    monkeypatch.setattr(block_matmul, "block_kernels", lambda: None)  # no compiler, or no SIMD
    assert resolve_cpu_quant_kernel("auto") == "torch"
    assert resolve_cpu_quant_kernel("torch") == "torch"
    with pytest.raises(ValueError, match="--cpu-quant-kernel blocks: the C\\+\\+ block kernels"):
        resolve_cpu_quant_kernel("blocks")


@pytest.fixture(scope="module")
def tied_q8_gguf(tmp_path_factory):
    """The tiny GGUF with its head tied to a Q8_0 token_embd (as the default model's is)."""
    root = tmp_path_factory.mktemp("tied_gguf")
    write_tiny_gguf(save_plain_llama(root / "hf"), root / "tiny.gguf", head=None)
    return root / "tiny.gguf"


def _greedy_and_logits(path, kernel: str, **options):
    load = LoadConfig(
        model=str(path), device="cpu", quantization="gguf", cpu_quant_kernel=kernel, **options
    )
    runner = ModelRunner.create(load, CacheConfig(max_total_tokens=256))
    table = runner.pool.extend_page_table([], len(PROMPT))
    batch = ForwardBatch.build([PROMPT], [0], [table], 16, return_all_logits=True)
    logits = runner.forward(batch).all
    return runner.model, logits.argmax(-1), logits


def test_loader_puts_layers_and_a_q8_head_on_the_blocks_with_the_same_greedy_tokens(
    cpu_ops, tied_q8_gguf
):
    if resolve_cpu_quant_kernel("auto") != "blocks":
        pytest.skip("the block kernels built without AVX2 / AVX512 here: auto keeps torch's")
    ours, our_tokens, our_logits = _greedy_and_logits(tied_q8_gguf, "auto")
    theirs, their_tokens, their_logits = _greedy_and_logits(tied_q8_gguf, "torch")
    assert ours.layers[0].mlp.down_proj.backend == "blocks"
    # fp32 kernels; a prefill chunk's dense matmul in the int layers' dtype (bf16 here)
    assert ours.layers[0].mlp.down_proj.dense_dtype == torch.bfloat16
    assert isinstance(ours.lm_head, Int8WeightOnlyLinear) and ours.lm_head.backend == "blocks"
    assert theirs.lm_head is None  # torch's kernels: the dense tied head
    assert torch.equal(our_tokens, their_tokens)
    # theirs runs bf16 activations and bf16-rounded scales; ours fp32 throughout
    torch.testing.assert_close(our_logits, their_logits, atol=0.05, rtol=0)


def test_a_tied_blocks_head_is_the_embeddings_table_and_dense_past_its_rows_unless_deterministic(
    cpu_ops, tied_q8_gguf
):
    """No fp copy of the tied table: a lookup dequantizes its tokens' rows from the head's own
    blocks, and from dequant_min_rows rows on the head dequantizes for one dense matmul."""
    if resolve_cpu_quant_kernel("auto") != "blocks":
        pytest.skip("the block kernels built without AVX2 / AVX512 here: auto keeps torch's")
    model = _greedy_and_logits(tied_q8_gguf, "blocks")[0]
    head = model.lm_head
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.embed_tokens.table is head
    ids = torch.tensor([5, 0, 255, 5])
    rows = head.dequantize(torch.float32)[ids].to(model.embed_tokens.dtype)
    assert torch.equal(model.embed_tokens(ids), rows)
    assert head.dequant_min_rows is not None
    x = torch.randn(head.dequant_min_rows, head.in_features)
    with torch.inference_mode():
        dense = head(x)  # the dequantized head in its dense dtype
        head.dequant_min_rows = None
        torch.testing.assert_close(head(x), dense, atol=0.05, rtol=0.02)
    flagged = _greedy_and_logits(tied_q8_gguf, "blocks", enable_deterministic_inference=True)
    assert flagged[0].lm_head.dequant_min_rows is None  # row-invariant: blocks for every batch
