"""--enable-deterministic-inference: a row's result does not depend on how many rows share
its batch. Layers: each quantized kind (int8, int4, GGUF Q4_0 / Q4_1 / Q8_0 and the K-quants
Q4_K / Q5_K / Q6_K) and the fp
BatchInvariantLinear, one row alone vs the same row inside batches. Whole models, with the
attention the flag picks (cpu_fused's extend kernel for every query): K+1 verify rows give
bitwise the logits of K+1 one-row decodes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from kquant_reference import quantize_kquant
from test_quantization_gguf import save_plain_llama, write_tiny_gguf

from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.quant.batch_invariant import BatchInvariantLinear
from radixserve.model.quant.gguf_weights import decode_block_weight, fused_layer
from radixserve.model.quant.linear import (
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    UnquantizedLinear,
)
from radixserve.model.runner import ModelRunner

IN, OUT = 128, 96
BATCH_SIZES = [*range(2, 17), 40, 130]  # 130: past DEQUANT_MIN_ROWS, the prefill path
NUM_VERIFY = 5  # a verify of 4 draft tokens + 1


def _weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(OUT, IN) / math.sqrt(IN)


def _gguf_layer(qtype: T, backend: str | None = None) -> torch.nn.Module:
    """A layer built the way the GGUF loader builds it, from the gguf package's blocks."""
    tensor = SimpleNamespace(tensor_type=qtype, name="w", data=quantize(_weight().numpy(), qtype))
    weights = [decode_block_weight(tensor)]
    return fused_layer(weights, torch.float32, torch.device("cpu"), "w", backend)


def _kquant_layer(qtype: T) -> torch.nn.Module:
    """A K-quant layer as the GGUF loader builds it, 256 inputs (one super-block a row)."""
    torch.manual_seed(0)
    weight = torch.randn(OUT, 256).numpy() / 16
    tensor = SimpleNamespace(tensor_type=qtype, name="w", data=quantize_kquant(weight, qtype.name))
    weights = [decode_block_weight(tensor, kquants=True)]
    return fused_layer(weights, torch.float32, torch.device("cpu"), "w", "blocks")


def _int4() -> Int4WeightOnlyLinear:
    return Int4WeightOnlyLinear.from_float(torch.nn.Linear(IN, OUT).requires_grad_(False), 32)


QUANT_LAYERS = {
    "int8": lambda: Int8WeightOnlyLinear.from_float(torch.nn.Linear(IN, OUT)),
    "int4": _int4,
    "gguf-Q4_0": lambda: _gguf_layer(T.Q4_0),
    "gguf-Q4_1": lambda: _gguf_layer(T.Q4_1),
    "gguf-Q8_0": lambda: _gguf_layer(T.Q8_0),
    "blocks-Q4_0": lambda: _gguf_layer(T.Q4_0, "blocks"),  # the C++ block kernels
    "blocks-Q4_1": lambda: _gguf_layer(T.Q4_1, "blocks"),
    "blocks-Q8_0": lambda: _gguf_layer(T.Q8_0, "blocks"),
    "blocks-Q4_K": lambda: _kquant_layer(T.Q4_K),  # the C++ K-quant kernels
    "blocks-Q5_K": lambda: _kquant_layer(T.Q5_K),
    "blocks-Q6_K": lambda: _kquant_layer(T.Q6_K),
}


def _assert_row_invariant(layer: torch.nn.Module, dtype: torch.dtype) -> None:
    """Row 0 of `x`, alone and at several places inside batches of BATCH_SIZES rows."""
    torch.manual_seed(1)
    row = torch.randn(1, layer.in_features, dtype=dtype)
    with torch.inference_mode():
        alone = layer(row)[0]
        for num_rows in BATCH_SIZES:
            for place in sorted({0, num_rows // 2, num_rows - 1}):
                batch = torch.randn(num_rows, layer.in_features, dtype=dtype)
                batch[place] = row[0]
                assert torch.equal(layer(batch)[place], alone), (num_rows, place)


@pytest.mark.parametrize("kind", list(QUANT_LAYERS))
def test_quantized_layer_row_is_bitwise_the_same_alone_and_in_batches(kind, request):
    if kind.startswith("blocks"):
        request.getfixturevalue("cpu_ops")  # skips where there is no compiler
    layer = QUANT_LAYERS[kind]()
    if layer.compute_dtype is not None:  # the block kernels compute in fp32 whatever the flag
        layer.set_compute_dtype(torch.bfloat16)  # what --dtype auto runs on CPU
    layer.dequant_min_rows = None  # as configure_int_layers sets it under the flag
    _assert_row_invariant(layer, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_batch_invariant_linear_row_is_bitwise_the_same_alone_and_in_batches(dtype, bias):
    linear = torch.nn.Linear(IN, OUT, bias=bias, dtype=dtype).requires_grad_(False)
    layer = BatchInvariantLinear.from_linear(linear)
    _assert_row_invariant(layer, dtype)
    x = torch.randn(7, IN, dtype=dtype)
    with torch.inference_mode():
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(layer(x), linear(x), atol=tolerance, rtol=tolerance)
        assert layer(x[:1]).shape == (1, OUT) and layer(x.view(7, 1, IN)).shape == (7, 1, OUT)


# ---- whole models -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("invariance_gguf")
    write_tiny_gguf(save_plain_llama(root / "hf"), root / "tiny.gguf")
    return str(root / "tiny.gguf")


def _runner(model: str, quantization: str, deterministic: bool) -> ModelRunner:
    load = LoadConfig(
        model=model,
        device="cpu",
        quantization=quantization,
        enable_deterministic_inference=deterministic,
    )
    return ModelRunner.create(load, CacheConfig(page_size=16, max_total_tokens=512))


def _decode_and_verify_logits(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of NUM_VERIFY tokens after a prompt: one-row decodes, then one verify extend."""
    prompt = [1, 5, 7, 9, 11, 3, 4, 100, 200, 17, 18, 19, 20, 21, 22, 23, 40]
    tokens = [44, 45, 46, 47, 48]
    table = runner.pool.extend_page_table([], len(prompt) + len(tokens))

    def run(ids: list[int], prefix: int) -> torch.Tensor:
        batch = ForwardBatch.build([ids], [prefix], [table], 16, verify_indices=range(len(ids)))
        return runner.forward(batch).verify

    run(prompt, 0)
    decoded = torch.cat([run([t], len(prompt) + i) for i, t in enumerate(tokens)])
    return decoded, run(tokens, len(prompt))


MODELS = {"gguf": "gguf", "int4": "llama", "int8": "qwen2", "none": "qwen3"}  # qwen3: tied


@pytest.mark.parametrize("quantization", list(MODELS))
def test_verify_rows_are_bitwise_the_decode_rows_under_the_flag(
    tiny_models, tiny_gguf, quantization
):
    arch = MODELS[quantization]
    model = tiny_gguf if arch == "gguf" else str(tiny_models[arch])
    runner = _runner(model, quantization, deterministic=True)
    if not getattr(runner.attn, "deterministic", False):
        pytest.skip("cpu_fused did not build here; torch_native is not batch-invariant")
    assert isinstance(runner.model.lm_head, BatchInvariantLinear)
    assert not any(isinstance(m, UnquantizedLinear) for m in runner.model.modules())
    decoded, verified = _decode_and_verify_logits(runner)
    assert torch.equal(decoded, verified)


def test_the_flag_swaps_fp_layers_keeping_their_weights(tiny_models):
    folder = str(tiny_models["qwen3"])  # tied: the head is the embedding
    plain = _runner(folder, "none", deterministic=False)
    invariant = _runner(folder, "none", deterministic=True)
    assert plain.model.lm_head is None
    head = invariant.model.lm_head
    assert torch.equal(head.weight(), invariant.model.embed_tokens.weight)
    assert isinstance(plain.model.layers[0].mlp.down_proj, UnquantizedLinear)
    down = invariant.model.layers[0].mlp.down_proj
    assert isinstance(down, BatchInvariantLinear)
    assert torch.equal(down.weight(), plain.model.layers[0].mlp.down_proj.weight)
    expected = _decode_and_verify_logits(plain)[1]
    torch.testing.assert_close(_decode_and_verify_logits(invariant)[1], expected)
