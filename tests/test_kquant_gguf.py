"""K-quant GGUFs through the public loader: a tiny llama (hidden 256, so rows hold whole
super-blocks) written with our reference quantizer in llama.cpp's mixes — Q4_K_M's Q4_K
projections beside a Q6_K attn_v and ffn_down, a Q6_K head, tied or untied, old Q4_0 / Q8_0
types in the same file — loads as K-quant layers whose weights are the gguf package's own
dequantization, and predicts like the fp32 model of the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from kquant_reference import quantize_iq4_nl, quantize_kquant
from test_quantization_gguf import PROMPT, permute, reverse_permute

from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.quant.block_matmul import resolve_cpu_quant_kernel
from radixserve.model.quant.gguf_weights import loads_as_is, read_gguf, why_not_as_is
from radixserve.model.quant.kquant import KQUANT_TYPES, KQuantLinear
from radixserve.model.quant.linear import Int8WeightOnlyLinear, UnquantizedLinear
from radixserve.model.quant.stacked_linear import StackedLinear
from radixserve.model.runner import ModelRunner

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 256
CONFIG = dict(
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    initializer_range=0.05,
    eos_token_id=None,
)
# GGUF part -> (HF part, type in layer 0, type in layer 1): layer 0 as Q4_K_M writes its
# "more bits" layers; layer 1 mixes in the older block types
PARTS = {
    "attn_q": ("self_attn.q_proj", T.Q4_K, T.Q4_K),
    "attn_k": ("self_attn.k_proj", T.Q4_K, T.Q4_K),
    "attn_v": ("self_attn.v_proj", T.Q6_K, T.Q4_K),
    "attn_output": ("self_attn.o_proj", T.Q4_K, T.Q4_0),
    "ffn_gate": ("mlp.gate_proj", T.Q4_K, T.Q8_0),
    "ffn_up": ("mlp.up_proj", T.Q4_K, T.Q5_K),
    "ffn_down": ("mlp.down_proj", T.Q6_K, T.Q5_K),
}

NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _store(w: np.ndarray, qtype: T) -> np.ndarray:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == T.F32:
        return w
    if qtype == T.IQ4_NL:  # the gguf package reads IQ4_NL but cannot write it
        return quantize_iq4_nl(w)
    return quantize_kquant(w, qtype.name) if qtype.name in KQUANT_TYPES else quantize(w, qtype)


def _add(writer: GGUFWriter, name: str, w: np.ndarray, qtype: T) -> np.ndarray:
    """Writes `w` as `qtype`; returns what the gguf package reads back."""
    stored = _store(w, qtype)
    writer.add_tensor(name, stored, **({} if qtype == T.F32 else {"raw_dtype": qtype}))
    return stored if qtype == T.F32 else dequantize(stored, qtype)


def write_kquant_gguf(
    hf_folder, path, head: T | None, embed: T = T.Q4_K, parts: dict | None = None
) -> dict:
    """The tiny HF llama as a GGUF (`head`: output.weight's type, None: tied to token_embd;
    `parts`: PARTS' form, default PARTS); returns every HF tensor as the gguf package reads it
    back (un-permuted)."""
    parts = PARTS if parts is None else parts
    from safetensors.numpy import load_file

    hf = load_file(hf_folder / "model.safetensors")
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    embedding = _add(writer, "token_embd.weight", hf["model.embed_tokens.weight"], embed)
    back = {"model.embed_tokens.weight": embedding}
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    back["model.norm.weight"] = hf["model.norm.weight"]
    if head is not None:
        back["lm_head.weight"] = _add(writer, "output.weight", hf["lm_head.weight"], head)
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        for gguf_name, hf_name in NORMS.items():
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", hf[f"{prefix}{hf_name}.weight"])
            back[f"{prefix}{hf_name}.weight"] = hf[f"{prefix}{hf_name}.weight"]
        for part, (hf_part, *types) in parts.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(part)
            w = hf[f"{prefix}{hf_part}.weight"]
            stored = permute(w, heads) if heads else w
            read = _add(writer, f"blk.{layer}.{part}.weight", stored, types[layer])
            back[f"{prefix}{hf_part}.weight"] = reverse_permute(read, heads) if heads else read
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return back


def save_llama(folder, tie: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, tie_word_embeddings=tie)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["untied", "tied"])
def kquant_gguf(request, tmp_path_factory):
    """(the GGUF, an fp32 HF folder holding exactly the values the GGUF stands for)."""
    from safetensors.torch import save_file

    tied = request.param == "tied"
    root = tmp_path_factory.mktemp(f"kquant_{request.param}")
    hf_folder = save_llama(root / "hf", tie=tied)
    head, embed = (None, T.Q6_K) if tied else (T.Q6_K, T.Q4_K)
    back = write_kquant_gguf(hf_folder, root / "tiny.gguf", head=head, embed=embed)
    reference = save_llama(root / "reference", tie=tied)
    tensors = {name: torch.from_numpy(np.ascontiguousarray(w)) for name, w in back.items()}
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})
    return root / "tiny.gguf", reference


def _needs_blocks():
    if resolve_cpu_quant_kernel("auto") != "blocks":
        pytest.skip("the block kernels built without AVX2 / AVX512 here: auto keeps torch's")


def _runner(path, **options) -> ModelRunner:
    load = LoadConfig(model=str(path), device="cpu", dtype="float32", **options)
    return ModelRunner.create(load, CacheConfig(max_total_tokens=256))


def _logits(runner: ModelRunner) -> torch.Tensor:
    table = runner.pool.extend_page_table([], len(PROMPT))
    batch = ForwardBatch.build([PROMPT], [0], [table], 16, return_all_logits=True)
    return runner.forward(batch).all


def test_auto_keeps_k_quant_blocks_and_stacks_parts_of_different_types(cpu_ops, kquant_gguf):
    _needs_blocks()
    path, reference = kquant_gguf
    assert loads_as_is(read_gguf(path), kquants=True)
    assert not loads_as_is(read_gguf(path))  # without the block kernels: dequantized
    assert "K-quants need the C++ block kernels" in why_not_as_is(read_gguf(path))
    model = _runner(path).model
    first, second = model.layers
    qkv = first.self_attn.qkv_proj  # Q4_K q and k rows, then the Q6_K v rows
    assert isinstance(qkv, StackedLinear)  # a K-quant layer per part: the file's bytes
    parts = [(p.type_name, p.out_features) for p in qkv.parts]
    assert parts == [("Q4_K", 256), ("Q4_K", 128), ("Q6_K", 128)]
    assert first.mlp.down_proj.type_name == "Q6_K"
    assert [p.type_name for p in second.self_attn.qkv_proj.parts] == ["Q4_K"] * 3
    gate, up = second.mlp.gate_up_proj.parts
    assert isinstance(gate, Int8WeightOnlyLinear) and up.type_name == "Q5_K"
    assert isinstance(model.lm_head, KQuantLinear) and model.lm_head.type_name == "Q6_K"
    assert model.layers[0].mlp.down_proj.dense_dtype == torch.float32


def test_k_quant_layers_hold_ggufs_dequantized_values(cpu_ops, kquant_gguf):
    _needs_blocks()
    from safetensors.torch import load_file

    path, reference = kquant_gguf
    expected = load_file(reference / "model.safetensors")
    model = _runner(path).model
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        qkv = torch.cat([expected[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.dequantize(torch.float32), qkv)
        down = expected[f"{prefix}mlp.down_proj.weight"]
        assert torch.equal(layer.mlp.down_proj.dequantize(torch.float32), down)
    head = expected.get("lm_head.weight", expected["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.dequantize(), head)
    embedding = model.embed_tokens(torch.arange(VOCAB))  # rows dequantized from the blocks
    assert torch.equal(embedding, expected["model.embed_tokens.weight"])


def test_k_quant_model_predicts_like_the_fp32_model_of_the_same_values(cpu_ops, kquant_gguf):
    _needs_blocks()
    path, reference = kquant_gguf
    ours = _logits(_runner(path))
    fp32 = _logits(_runner(reference, quantization="none"))
    assert fp32.abs().max() > 0.1
    torch.testing.assert_close(ours, fp32, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), fp32.argmax(-1))


def test_deterministic_inference_keeps_every_batch_on_the_k_quant_kernels(cpu_ops, kquant_gguf):
    _needs_blocks()
    model = _runner(kquant_gguf[0], enable_deterministic_inference=True).model
    layers = [m for m in model.modules() if isinstance(m, KQuantLinear)]
    assert layers and all(layer.dequant_min_rows is None for layer in layers)


def test_torchs_kernels_dequantize_k_quants_to_fp_and_keep_the_rest(cpu_ops, kquant_gguf):
    path, reference = kquant_gguf
    runner = _runner(path, quantization="gguf", cpu_quant_kernel="torch")
    model = runner.model
    assert isinstance(model.layers[0].mlp.down_proj, UnquantizedLinear)
    assert not any(isinstance(m, KQuantLinear) for m in model.modules())
    up = model.layers[1].mlp.gate_up_proj  # Q8_0 gate on torch's int8 kernel, Q5_K up as fp
    assert isinstance(up.parts[0], Int8WeightOnlyLinear) and up.parts[0].backend == "torch"
    assert isinstance(up.parts[1], UnquantizedLinear)
    fp32 = _logits(_runner(reference, quantization="none"))
    torch.testing.assert_close(_logits(runner), fp32, atol=0.05, rtol=0)  # int8 in bf16


def test_int8_activations_through_the_loader_predict_like_the_fp32_model(cpu_ops, kquant_gguf):
    """--cpu-quant-activation int8 on every block type of the file (Q4_K, Q5_K, Q6_K, Q4_0,
    Q8_0, the Q6_K head): logits within the int8 activations' tolerance of the fp32 model of
    the same values, and its greedy tokens wherever they are clearer than that."""
    _needs_blocks()
    path, reference = kquant_gguf
    runner = _runner(path, cpu_quant_activation="int8")
    lookup = runner.model.embed_tokens.table  # untied: only looked up, never multiplied
    layers = [
        m
        for m in runner.model.modules()
        if hasattr(m, "int8_activations") and (m is not lookup or m is runner.model.lm_head)
    ]
    blocks = [
        m for m in layers if isinstance(m, KQuantLinear) or getattr(m, "backend", "") == "blocks"
    ]
    assert blocks and all(m.int8_activations for m in blocks)
    ours = _logits(runner)
    fp32 = _logits(_runner(reference, quantization="none"))
    # the activations' rounding (~0.3% of a dot per matmul) through 2 layers and the head:
    # measured max 3.2% of the largest logit, mean 0.6%
    error = (ours - fp32).abs()
    scale = fp32.abs().max()
    assert error.max() <= 0.05 * scale and error.mean() <= 0.01 * scale
    # greedy tokens: the fp32 one wherever fp32's choice is clearer than the error
    margin = fp32.max(-1).values - fp32.gather(-1, ours.argmax(-1, keepdim=True)).squeeze(-1)
    assert (margin <= 2 * error.max()).all()
    assert (ours.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8
