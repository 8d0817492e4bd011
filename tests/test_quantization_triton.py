"""The CUDA path of the int4 / int8 layers (Triton dequant-GEMM), run on CPU under
TRITON_INTERPRET=1 by forcing the "triton" backend: each layer's forward against its own
dequantized weight, whole int4 and GGUF models against the torch-kernel path, and the
start-up checks that now let int4 and gguf run on CUDA."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before radixserve_kernels.quant_matmul loads

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from test_quantization_gguf import save_plain_llama, write_tiny_gguf  # noqa: E402

from radixserve.config import CacheConfig, LoadConfig, ModelConfig  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.quant import linear as quant_linear  # noqa: E402
from radixserve.model.quant.block_matmul import block_kernels  # noqa: E402
from radixserve.model.quant.linear import (  # noqa: E402
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    dequantize_int4,
    matmul_backend,
)
from radixserve.model.quant.quantize import (  # noqa: E402
    PROJECTIONS,
    QuantizationError,
    check_quantization,
)
from radixserve.model.runner import ModelRunner  # noqa: E402

LINEAR_TOL = dict(atol=1e-5, rtol=1e-5)
PROMPTS = [[1, 5, 7, 9, 11, 3, 4, 100, 200, 17, 18, 19, 20], [3, 4, 5]]


def _int4_parts(out_features: int, in_features: int, group_size: int):
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    scales = torch.rand(out_features, in_features // group_size, generator=gen) / 8
    zeros = torch.randn(out_features, in_features // group_size, generator=gen) / 4
    return codes, scales, zeros


# ---- one layer ----------------------------------------------------------------------------


def test_the_backend_follows_the_device():
    assert matmul_backend(torch.device("cuda")) == "triton"
    assert matmul_backend(torch.device("cpu")) == "torch"
    codes, scales, zeros = _int4_parts(32, 64, 32)
    assert Int4WeightOnlyLinear(codes, scales, zeros, 32).backend == "torch"
    q = codes.to(torch.int8)
    assert Int8WeightOnlyLinear(q, scales, group_size=32).backend == "torch"
    # per channel stays on torch's _weight_int8pack_mm on every device unless told otherwise
    assert Int8WeightOnlyLinear(q, scales[:, 0]).backend == "torch"


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_triton_layer_matches_its_dequantized_weight(group_size):
    codes, scales, zeros = _int4_parts(40, 256, group_size)  # 40: not a multiple of 16
    bias = torch.randn(40)
    layer = Int4WeightOnlyLinear(codes, scales, zeros, group_size, bias, backend="triton")
    reference = dequantize_int4(codes, scales, zeros, group_size)
    torch.testing.assert_close(layer.dequantize(), reference)
    x = torch.randn(2, 3, 256)  # leading dims flattened and restored
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, reference, bias), **LINEAR_TOL)


def test_int4_triton_and_cpu_layers_agree():
    codes, scales, zeros = _int4_parts(48, 128, 64)
    cpu = Int4WeightOnlyLinear(codes, scales, zeros, 64)
    triton = Int4WeightOnlyLinear(codes, scales, zeros, 64, backend="triton")
    x = torch.randn(5, 128)
    torch.testing.assert_close(triton.dequantize(), cpu.dequantize(), **LINEAR_TOL)
    with torch.inference_mode():
        torch.testing.assert_close(triton(x), cpu(x), **LINEAR_TOL)


@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_triton_layer_matches_its_dequantized_weight(group_size):
    gen = torch.Generator().manual_seed(1)
    qweight = torch.randint(-127, 128, (36, 96), generator=gen, dtype=torch.int8)
    groups = () if group_size is None else (96 // group_size,)
    scales = torch.rand(36, *groups, generator=gen) / 100
    layer = Int8WeightOnlyLinear(qweight, scales, group_size=group_size, backend="triton")
    torch_layer = Int8WeightOnlyLinear(qweight, scales, group_size=group_size, backend="torch")
    scale = scales[:, None] if group_size is None else scales.repeat_interleave(32, dim=1)
    reference = qweight.float() * scale
    torch.testing.assert_close(layer.dequantize(), reference)
    torch.testing.assert_close(torch_layer.dequantize(), reference)
    x = torch.randn(7, 96)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ reference.t(), **LINEAR_TOL)


def test_bad_backends_fail_naming_it():
    codes, scales, zeros = _int4_parts(16, 32, 32)
    with pytest.raises(ValueError, match="backend must be one of torch, triton"):
        Int4WeightOnlyLinear(codes, scales, zeros, 32, backend="cuda")
    with pytest.raises(ValueError, match="backend 'torch' runs on CPU only"):
        meta = [t.to("meta") for t in (codes, scales, zeros)]
        Int4WeightOnlyLinear(*meta, 32, backend="torch")


# ---- whole models -------------------------------------------------------------------------


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Every quantized layer built from here on takes the CUDA path (the interpreter runs it)."""
    monkeypatch.setattr(quant_linear, "matmul_backend", lambda device: "triton")


def _runner_logits(load: LoadConfig) -> tuple[ModelRunner, torch.Tensor]:
    runner = ModelRunner.create(load, CacheConfig(max_total_tokens=256))
    tables = [runner.pool.extend_page_table([], len(p)) for p in PROMPTS]
    batch = ForwardBatch.build(PROMPTS, [0] * len(PROMPTS), tables, 16, return_all_logits=True)
    return runner, runner.forward(batch).all


def _backends(runner: ModelRunner) -> set[str]:
    layers = [getattr(getattr(layer, p.split(".")[0]), p.split(".")[1]) for p in PROJECTIONS
              for layer in runner.model.layers]  # fmt: skip
    return {getattr(layer, "backend", "fp") for layer in layers}


def test_int4_model_on_the_triton_path_matches_the_torch_path(tiny_models, request):
    load = LoadConfig(model=str(tiny_models["llama"]), device="cpu", quantization="int4",
                      dtype="float32", quantize_lm_head=True,
                      cpu_quant_kernel="torch")  # fmt: skip
    torch_runner, want = _runner_logits(load)
    request.getfixturevalue("triton_on_cpu")
    triton_runner, got = _runner_logits(load)
    assert _backends(torch_runner) == {"torch"} and _backends(triton_runner) == {"triton"}
    assert triton_runner.model.lm_head.backend == "triton"
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_gguf_model_on_the_triton_path_matches_the_torch_path(tmp_path, request):
    hf_folder = save_plain_llama(tmp_path / "hf")
    write_tiny_gguf(hf_folder, tmp_path / "tiny.gguf")  # Q4_0, Q4_1, Q8_0 and F32 layers
    load = LoadConfig(model=str(tmp_path / "tiny.gguf"), device="cpu", quantization="gguf",
                      dtype="float32", cpu_quant_kernel="torch")  # fmt: skip
    _, want = _runner_logits(load)
    request.getfixturevalue("triton_on_cpu")
    runner, got = _runner_logits(load)
    assert _backends(runner) == {"triton", "fp"}
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


# ---- start-up checks ----------------------------------------------------------------------

ODD_VOCAB = ModelConfig.from_hf_dict(
    dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=250,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )  # fmt: skip
)  # an LM head of 250 rows: torch's CPU int4 packer needs a multiple of 16


@pytest.mark.parametrize("method", ["int4", "gguf"])
def test_int4_and_gguf_are_accepted_on_cuda(method):
    lm_head = method == "int4"
    check_quantization(
        LoadConfig(device="cuda", quantization=method, quantize_lm_head=lm_head), ODD_VOCAB
    )


def test_cpu_int4_on_torchs_kernel_needs_out_features_divisible_by_16():
    """torch's packer needs it; the block kernels (groups of 32, the default where they
    build) take any out_features."""
    load = LoadConfig(device="cpu", quantization="int4", quantize_lm_head=True, dtype="bfloat16")
    for torchs in (
        replace(load, cpu_quant_kernel="torch"),
        replace(load, quantization_group_size=64),
    ):
        with pytest.raises(QuantizationError, match="lm_head has out_features=250"):
            check_quantization(torchs, ODD_VOCAB)
    if block_kernels() is not None:
        check_quantization(load, ODD_VOCAB)


def test_int4_refuses_other_devices_and_cuda_without_triton(monkeypatch):
    with pytest.raises(QuantizationError, match="runs on CPU or CUDA; device is mps"):
        check_quantization(LoadConfig(device="mps", quantization="int4"), ODD_VOCAB)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name)
    )
    with pytest.raises(QuantizationError, match="gguf on cuda needs triton"):
        check_quantization(LoadConfig(device="cuda", quantization="gguf"), ODD_VOCAB)
