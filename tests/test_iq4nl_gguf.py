"""IQ4_NL GGUFs (a 4-bit index into ggml's table of 16 int8 values, one fp16 scale per 32
weights) loaded as blocks: each code's table value is an int8 code under the same scale, so
the file's weights run exactly on the Q8_0 kernels (gguf_blocks.decode_block_weight)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from test_kquant_gguf import PARTS, _logits, _needs_blocks, _runner, save_llama, write_kquant_gguf

from radixserve.model.quant.gguf_weights import loads_as_is, read_gguf
from radixserve.model.quant.linear import Int8WeightOnlyLinear

IQ4_PARTS = {part: (hf, T.IQ4_NL, T.IQ4_NL) for part, (hf, *_) in PARTS.items()}
IQ4_PARTS["ffn_down"] = (PARTS["ffn_down"][0], T.IQ4_NL, T.Q4_K)  # as files mix types


def test_iq4_nl_runs_as_int8_blocks_with_the_files_values(cpu_ops, tmp_path):
    _needs_blocks()
    from safetensors.torch import save_file

    hf_folder = save_llama(tmp_path / "hf", tie=False)
    path = tmp_path / "iq4nl.gguf"
    back = write_kquant_gguf(hf_folder, path, head=T.Q6_K, embed=T.IQ4_NL, parts=IQ4_PARTS)
    reference = save_llama(tmp_path / "reference", tie=False)
    tensors = {name: torch.from_numpy(np.ascontiguousarray(w)) for name, w in back.items()}
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})

    assert loads_as_is(read_gguf(path), kquants=True)  # auto: the blocks, not an fp32 copy
    runner = _runner(path)
    layer = runner.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Int8WeightOnlyLinear)  # gate and up, one layer
    assert isinstance(layer.self_attn.qkv_proj, Int8WeightOnlyLinear)
    assert torch.equal(
        layer.mlp.down_proj.dequantize(torch.float32),
        tensors["model.layers.0.mlp.down_proj.weight"],
    )
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    embedding = runner.model.embed_tokens(torch.arange(vocab))  # rows from the IQ4_NL blocks
    assert torch.equal(embedding, tensors["model.embed_tokens.weight"])
    ours = _logits(runner)
    fp32 = _logits(_runner(reference, quantization="none"))
    assert fp32.abs().max() > 0.1
    torch.testing.assert_close(ours, fp32, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), fp32.argmax(-1))
