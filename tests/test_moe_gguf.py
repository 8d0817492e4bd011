"""Mixture-of-experts GGUFs in llama.cpp's layout (qwen3moe, qwen2moe, Mixtral as llama with
experts) written with the gguf package from tiny transformers models: F32 files give
transformers' greedy tokens; experts stored as Q8_0 / Q4_0 blocks run on the block kernels,
per expert, with the logits of the same file dequantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize
from kquant_reference import quantize_kquant
from test_moe import CONFIGS, PROMPTS, hf_greedy_choices
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from conftest import greedy_generate, hf_model, make_runner
from radixserve.config import CacheConfig, LoadConfig, ModelConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.loader import load_model, read_hf_config
from radixserve.model.quant.kquant import KQuantLinear
from radixserve.model.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from radixserve.model.runner import ModelRunner

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
DENSE = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
SHARED = {"gate_proj": "ffn_gate_shexp", "up_proj": "ffn_up_shexp", "down_proj": "ffn_down_shexp"}
QUANTIZED = {  # the block variant: experts' gate / up Q8_0, down Q4_0; Qwen2's q / k / v Q8_0
    "ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q8_0, "ffn_down_exps": T.Q4_0,
    "ffn_gate_shexp": T.Q8_0, "ffn_up_shexp": T.Q8_0,  # its down (48 inputs): F32
    "attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0,
}  # fmt: skip
NUM_TOKENS = 8


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation of the llama architecture (Mixtral's too)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_moe_gguf(folder: Path, path: Path, arch: str, types: dict | None = None) -> None:
    """The HF model in `folder` as llama.cpp writes it; `types`: GGUF part -> block type."""
    from safetensors.numpy import load_file

    hf, config = (
        load_file(folder / "model.safetensors"),
        ModelConfig.from_hf_dict(read_hf_config(folder)),
    )
    moe, gguf_arch = config.moe, GGUF_ARCH[arch]
    writer = GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    if arch != "mixtral":
        writer.add_expert_feed_forward_length(moe.intermediate_size)
    if arch == "qwen2_moe":  # qwen3moe and Mixtral: llama.cpp's default (renormalize)
        writer.add_expert_weights_norm(False)
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)

    def add(name: str, value: np.ndarray, part: str = "") -> None:
        qtype = (types or {}).get(part, T.F32)
        if qtype == T.F32:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        elif qtype.name.endswith("_K"):  # our reference quantizer, row by row
            rows = quantize_kquant(
                value.reshape(-1, value.shape[-1]).astype(np.float32), qtype.name
            )
            writer.add_tensor(name, rows.reshape(*value.shape[:-1], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(value.astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", hf["model.embed_tokens.weight"])
    add("output_norm.weight", hf["model.norm.weight"])
    add("output.weight", hf["lm_head.weight"])
    for i in range(config.num_layers):
        p, blk = f"model.layers.{i}.", f"blk.{i}."
        add(blk + "attn_norm.weight", hf[p + "input_layernorm.weight"])
        add(blk + "ffn_norm.weight", hf[p + "post_attention_layernorm.weight"])
        for hf_part, part in ATTN.items():
            w = hf[f"{p}self_attn.{hf_part}.weight"]
            heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(hf_part)
            if arch == "mixtral" and heads:
                w = permute(w, heads)
            add(f"{blk}{part}.weight", w, part)
            if f"{p}self_attn.{hf_part}.bias" in hf:
                add(f"{blk}{part}.bias", hf[f"{p}self_attn.{hf_part}.bias"])
        for norm in ("q_norm", "k_norm"):
            if f"{p}self_attn.{norm}.weight" in hf:
                add(f"{blk}attn_{norm}.weight", hf[f"{p}self_attn.{norm}.weight"])
        if not config.is_sparse_layer(i):
            for hf_part, part in DENSE.items():
                add(f"{blk}{part}.weight", hf[f"{p}mlp.{hf_part}.weight"], part)
            continue
        mlp = f"{p}block_sparse_moe." if arch == "mixtral" else f"{p}mlp."
        add(blk + "ffn_gate_inp.weight", hf[mlp + "gate.weight"])
        for hf_part, part in EXPERTS.items():
            name = MIXTRAL[hf_part] if arch == "mixtral" else hf_part
            stacked = np.stack(
                [hf[f"{mlp}experts.{e}.{name}.weight"] for e in range(moe.num_experts)]
            )
            add(f"{blk}{part}.weight", stacked, part)
        if moe.shared_expert_intermediate_size:
            for hf_part, part in SHARED.items():
                add(f"{blk}{part}.weight", hf[f"{mlp}shared_expert.{hf_part}.weight"], part)
            add(blk + "ffn_gate_inp_shexp.weight", hf[mlp + "shared_expert_gate.weight"][0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """arch -> (HF folder, F32 GGUF, GGUF with block experts)."""
    root, files = tmp_path_factory.mktemp("moe_gguf"), {}
    for seed, (arch, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config(), dtype=torch.float32).save_pretrained(root / arch)
        write_moe_gguf(root / arch, root / f"{arch}-f32.gguf", arch)
        write_moe_gguf(root / arch, root / f"{arch}-q.gguf", arch, QUANTIZED)
        files[arch] = (root / arch, root / f"{arch}-f32.gguf", root / f"{arch}-q.gguf")
    return files


def _logits(load_config: LoadConfig, prompt: list[int]) -> torch.Tensor:
    runner = ModelRunner.create(load_config, CacheConfig(max_total_tokens=256))
    table = runner.pool.extend_page_table([], len(prompt))
    batch = ForwardBatch.build([prompt], [0], [table], 16, return_all_logits=True)
    return runner.forward(batch).all


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_f32_gguf_gives_transformers_greedy_tokens(ggufs, arch):
    folder, f32, _ = ggufs[arch]
    hf_config = ModelConfig.from_hf_dict(read_hf_config(folder))
    loaded = load_model(LoadConfig(model=str(f32), device="cpu"))
    assert loaded.config.moe == hf_config.moe and loaded.config.qkv_bias == hf_config.qkv_bias
    runner = make_runner(f32)
    tokens = greedy_generate(runner, PROMPTS[-2:], max_new_tokens=NUM_TOKENS)
    reference = hf_model(folder)
    for prompt, out in zip(PROMPTS[-2:], tokens):
        assert hf_greedy_choices(reference, prompt, out) == out


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_block_experts_run_per_expert_with_the_dequantized_logits(ggufs, arch):
    _, _, quantized = ggufs[arch]
    load = LoadConfig(model=str(quantized), device="cpu", dtype="float32")
    model = load_model(load).model  # auto: the blocks as they are, on CPU
    sparse = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "gate_up_layers"))
    assert sparse.w13 is None and isinstance(sparse.gate_up_layers[0], Int8WeightOnlyLinear)
    assert isinstance(sparse.down_layers[-1], Int4WeightOnlyLinear)
    assert all(layer.backend == "blocks" for layer in sparse.gate_up_layers)
    if arch == "qwen2_moe":  # its shared expert and biased q / k / v from blocks too
        assert isinstance(sparse.shared_expert.gate_up_proj, Int8WeightOnlyLinear)
        assert model.layers[0].self_attn.qkv_proj.bias is not None
    prompt = PROMPTS[0]
    blocks = _logits(load, prompt)
    dequantized = _logits(
        LoadConfig(model=str(quantized), device="cpu", quantization="none"), prompt
    )
    torch.testing.assert_close(blocks, dequantized, atol=2e-4, rtol=1e-4)


def test_k_quant_experts_run_as_their_super_blocks(tmp_path, cpu_ops):
    """Q4_K gate / up and Q6_K down experts (llama.cpp's Q4_K_M mix) stay K-quant layers on
    the block kernels, with the logits of the same file dequantized."""
    torch.manual_seed(3)
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "hf")
    types = {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q6_K}
    write_moe_gguf(tmp_path / "hf", tmp_path / "k.gguf", "qwen3_moe", types)
    load = LoadConfig(model=str(tmp_path / "k.gguf"), device="cpu", dtype="float32")
    mlp = load_model(load).model.layers[0].mlp
    # gate and up: a K-quant layer each over the mapped file (stacking them would copy it)
    assert [[p.type_name for p in layer.parts] for layer in mlp.gate_up_layers] == [
        ["Q4_K", "Q4_K"]
    ] * 4
    assert all(isinstance(layer, KQuantLinear) for layer in mlp.down_layers)
    prompt = [t % 256 for t in PROMPTS[0]]
    dequantized = LoadConfig(model=str(tmp_path / "k.gguf"), device="cpu", quantization="none")
    torch.testing.assert_close(
        _logits(load, prompt), _logits(dequantized, prompt), atol=2e-4, rtol=1e-4
    )


def test_expert_parallel_block_experts_give_the_tokens_of_one_rank(ggufs):
    """--tp-size 2 --ep-size 2 (gloo) on the GGUF with Q8_0 / Q4_0 block experts: each rank
    holds three experts' block layers (and its cut of the blocked attention, the shared
    expert whole on rank 0); greedy tokens equal one rank's on the same file."""
    from radixserve.config import ParallelConfig
    from radixserve.model.tp_runner import TPModelRunner

    _, _, quantized = ggufs["qwen2_moe"]
    expected = greedy_generate(make_runner(quantized), PROMPTS[:2], max_new_tokens=NUM_TOKENS)
    runner = TPModelRunner.create(
        LoadConfig(model=str(quantized), device="cpu"),
        CacheConfig(page_size=16, max_total_tokens=1024),
        ParallelConfig(tp_size=2, ep_size=2),
    )
    try:
        sparse = runner.model.layers[1].mlp
        assert sparse.w13 is None and len(sparse.gate_up_layers) == 3  # rank 0's 3 of 6
        assert isinstance(sparse.gate_up_layers[0], Int8WeightOnlyLinear)
        tokens = greedy_generate(runner, PROMPTS[:2], max_new_tokens=NUM_TOKENS)
    finally:
        runner.close()
    assert tokens == expected
