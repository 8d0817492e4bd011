"""Which CPU kernel quantize-on-load's layers run: torch's int kernels (bf16 under --dtype
auto) or, for int4 in groups of 32, our C++ block kernels as a GGUF Q4_1 file's layers."""

from __future__ import annotations

import pytest
import torch
from test_quantization import _logits, _projections, quantized_runner

from radixserve.model.quant.block_matmul import block_kernels


@pytest.mark.parametrize(
    "mode,group_size", [("none", None), ("int8", None), ("int4", None), ("int4", 64)]
)
def test_auto_dtype_on_cpu_is_float32_with_bfloat16_int_kernels(tiny_models, mode, group_size):
    """torch's int kernels compute in bf16; int4 in groups of 32 runs the block kernels, fp32
    (bf16 only for a prefill's dequantized matmul)."""
    runner = quantized_runner(
        tiny_models["llama"], mode, dtype="auto", quantization_group_size=group_size
    )
    assert runner.model.embed_tokens.weight.dtype == torch.float32
    assert runner.pool.dtype == torch.float32
    layers = [getattr(o, a) for o, a in _projections(runner.model)]
    if mode == "int4" and group_size is None:
        assert {(layer.backend, layer.compute_dtype) for layer in layers} == {("blocks", None)}
        assert {layer.dense_dtype for layer in layers} == {torch.bfloat16}
    elif mode != "none":
        assert {(layer.backend, layer.compute_dtype) for layer in layers} == {
            ("torch", torch.bfloat16)
        }
    assert _logits(runner).isfinite().all()


@pytest.mark.parametrize("mode,group_size", [("int8", None), ("int4", 64)])
def test_float32_activations_with_torch_int_kernels_log_a_warning(
    tiny_models, caplog, mode, group_size
):
    with caplog.at_level("WARNING"):
        quantized_runner(
            tiny_models["llama"], mode, dtype="float32", quantization_group_size=group_size
        )
    assert "slow CPU path" in caplog.text


def test_int4_in_groups_of_32_runs_the_block_kernels_and_the_decode_stack(tiny_models, caplog):
    """--quantization int4 on CPU: groups of 32 are GGUF Q4_1-shaped blocks, run as the gguf
    layers are (fp32 activations, no slow-path warning, the C++ decode stack), with logits
    close to torch's int4 kernel on the same codes; --cpu-quant-kernel torch keeps torch's."""
    if block_kernels() is None:
        pytest.skip("the C++ block kernels need AVX2 / AVX512 here")
    with caplog.at_level("WARNING"):
        blocks = quantized_runner(tiny_models["llama"], "int4")
    assert "slow CPU path" not in caplog.text
    assert blocks.model.decode_stack is not None
    torch_int4 = quantized_runner(
        tiny_models["llama"], "int4", dtype="auto", cpu_quant_kernel="torch"
    )
    assert {getattr(o, a).backend for o, a in _projections(torch_int4.model)} == {"torch"}
    assert torch_int4.model.decode_stack is None
    got, ref = _logits(blocks), _logits(torch_int4)  # ref: bf16 activations
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
