"""`--quantization gguf`: a tiny GGUF written with the gguf package (Q4_0, Q4_1, Q8_0 and F32
projections, q/k permuted as llama.cpp stores them) loads as int4/int8 layers whose weights
are the gguf package's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from conftest import TINY
from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.loader import load_model
from radixserve.model.quant.gguf_weights import loads_as_is, read_gguf
from radixserve.model.quant.linear import (
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    UnquantizedLinear,
)
from radixserve.model.quant.quantize import QuantizationError
from radixserve.model.quant.stacked_linear import StackedLinear
from radixserve.model.runner import ModelRunner
from radixserve.model.source import ModelLoadError

HEADS, KV_HEADS = 4, 2  # conftest's TINY llama: q rows 64, k/v rows 32, intermediate 128
FUSED_ROWS = {  # HF part -> (our fused layer, the rows it fills there)
    "q_proj": ("qkv_proj", slice(0, 64)),
    "k_proj": ("qkv_proj", slice(64, 96)),
    "v_proj": ("qkv_proj", slice(96, 128)),
    "o_proj": ("o_proj", slice(None)),
    "gate_proj": ("gate_up_proj", slice(0, 128)),
    "up_proj": ("gate_up_proj", slice(128, 256)),
    "down_proj": ("down_proj", slice(None)),
}
LAYER_KIND = {
    T.Q4_0: Int4WeightOnlyLinear,
    T.Q4_1: Int4WeightOnlyLinear,
    T.Q8_0: Int8WeightOnlyLinear,
    T.F32: UnquantizedLinear,
}
SHAPE = {
    "block_count": 2,
    "context_length": 512,
    "embedding_length": 64,
    "feed_forward_length": 128,
    "head_count": HEADS,
    "head_count_kv": KV_HEADS,
}
PROMPT = [1, 5, 7, 9, 11, 3, 4, 100, 200, 17, 18, 19, 20, 21, 22, 23, 40]
# GGUF part -> (HF name part, type in layer 0, type in layer 1)
PARTS = {
    "attn_q": ("self_attn.q_proj", T.Q4_0, T.F32),
    "attn_k": ("self_attn.k_proj", T.Q4_0, T.F32),
    "attn_v": ("self_attn.v_proj", T.Q4_0, T.F32),
    "attn_output": ("self_attn.o_proj", T.Q4_1, T.Q8_0),
    "ffn_gate": ("mlp.gate_proj", T.Q8_0, T.Q4_0),
    "ffn_up": ("mlp.up_proj", T.Q8_0, T.Q4_0),
    "ffn_down": ("mlp.down_proj", T.Q4_1, T.Q4_1),
}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' inverse of it (integrations/ggml.py)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _store(w: np.ndarray, qtype: T) -> np.ndarray:
    return w.astype(np.float32) if qtype == T.F32 else quantize(w.astype(np.float32), qtype)


def write_tiny_gguf(hf_folder, path, types=None, head: T | None = T.F32) -> dict[str, np.ndarray]:
    """The tiny HF llama as a GGUF (`head`: output.weight's type; None: tied to token_embd);
    returns each HF projection's weight as read back by the gguf package (dequantized,
    un-permuted), i.e. what our layers must hold."""
    from safetensors.numpy import load_file

    hf = load_file(hf_folder / "model.safetensors")
    writer = GGUFWriter(str(path), "llama")
    for name, value in SHAPE.items():
        getattr(writer, f"add_{name}")(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tensor(
        "token_embd.weight", _store(hf["model.embed_tokens.weight"], T.Q8_0), raw_dtype=T.Q8_0
    )
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    if head is not None:
        stored = _store(hf["lm_head.weight"], head)
        writer.add_tensor("output.weight", stored, **({} if head == T.F32 else {"raw_dtype": head}))
    expected = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", hf[prefix + "input_layernorm.weight"])
        writer.add_tensor(
            f"blk.{layer}.ffn_norm.weight", hf[prefix + "post_attention_layernorm.weight"]
        )
        for part, (hf_part, *layer_types) in PARTS.items():
            qtype = (types or {}).get(part, layer_types[layer])
            w = hf[f"{prefix}{hf_part}.weight"]
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(part)
            stored = _store(permute(w, heads) if heads else w, qtype)
            raw = {} if qtype == T.F32 else {"raw_dtype": qtype}
            writer.add_tensor(f"blk.{layer}.{part}.weight", stored, **raw)
            back = dequantize(stored, qtype)
            expected[f"{prefix}{hf_part}"] = reverse_permute(back, heads) if heads else back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def save_plain_llama(folder):
    """conftest's tiny llama without RoPE scaling (which --quantization gguf rejects)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_gguf")
    hf_folder = save_plain_llama(root / "hf")
    expected = write_tiny_gguf(hf_folder, root / "tiny.gguf")
    return root / "tiny.gguf", hf_folder, expected


def _load(path):
    config = LoadConfig(model=str(path), device="cpu", quantization="gguf", dtype="float32")
    return load_model(config)


def _fused(model, hf_name: str):
    """(our fused layer, its rows that hold `hf_name`)."""
    layer = model.layers[int(hf_name.split(".")[2])]
    owner, part = hf_name.split(".")[3:5]
    fused, rows = FUSED_ROWS[part]
    return getattr(getattr(layer, owner), fused), rows


def test_our_gguf_reader_reads_what_ggufs_own_reader_reads(tiny_gguf, tmp_path):
    from gguf import GGUFReader

    path = tiny_gguf[0]
    ours, theirs = read_gguf(path), GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ModelLoadError, match="truncated.gguf: tensor .* past the end"):
        read_gguf(truncated)


def test_blocks_load_as_int4_int8_or_fp_and_equal_ggufs_dequantization(tiny_gguf):
    path, _, expected = tiny_gguf
    model = _load(path).model
    for hf_name, weight in expected.items():
        layer, rows = _fused(model, hf_name)
        part = next(p for p, (hf_part, *_) in PARTS.items() if hf_name.endswith(hf_part))
        assert isinstance(layer, LAYER_KIND[PARTS[part][1 + int(hf_name.split(".")[2])]]), hf_name
        if isinstance(layer, (Int4WeightOnlyLinear, Int8WeightOnlyLinear)):
            assert layer.group_size == 32
        ours = layer.dequantize()[rows]
        # Q4_0, Q8_0, F32: exact; Q4_1's zero m + 8d is one fp32 rounding away from q * d + m
        torch.testing.assert_close(ours, torch.from_numpy(weight), atol=1e-6, rtol=1e-6)


def test_gguf_model_logits_match_an_fp32_model_of_the_same_values(tiny_gguf, tmp_path):
    path, hf_folder, expected = tiny_gguf
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf_folder / "model.safetensors")
    tensors["model.embed_tokens.weight"] = torch.from_numpy(
        dequantize(quantize(tensors["model.embed_tokens.weight"].numpy(), T.Q8_0), T.Q8_0)
    )
    for hf_name, weight in expected.items():
        tensors[f"{hf_name}.weight"] = torch.from_numpy(np.ascontiguousarray(weight))
    reference = save_plain_llama(tmp_path / "ref")
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})
    ours = _runner_logits(
        LoadConfig(model=str(path), device="cpu", quantization="gguf", dtype="float32")
    )
    fp32 = _runner_logits(LoadConfig(model=str(reference), device="cpu"))
    assert fp32.abs().max() > 0.5
    torch.testing.assert_close(ours, fp32, atol=2e-4, rtol=0)


def _runner_logits(load_config: LoadConfig) -> torch.Tensor:
    runner = ModelRunner.create(load_config, CacheConfig(max_total_tokens=256))
    table = runner.pool.extend_page_table([], len(PROMPT))
    batch = ForwardBatch.build([PROMPT], [0], [table], 16, return_all_logits=True)
    return runner.forward(batch).all


def test_config_comes_from_the_gguf_metadata(tiny_gguf):
    path, hf_folder, _ = tiny_gguf
    config = _load(path).config
    hf = load_model(LoadConfig(model=str(hf_folder), device="cpu")).config
    assert (config.hidden_size, config.num_heads, config.num_kv_heads) == (64, HEADS, KV_HEADS)
    assert (config.num_layers, config.intermediate_size, config.vocab_size) == (2, 128, 256)
    assert config.tie_word_embeddings is False and hf.tie_word_embeddings is False


def test_unsupported_block_type_names_the_tensor_and_the_way_out(tiny_gguf, tmp_path):
    _, hf_folder, _ = tiny_gguf
    write_tiny_gguf(hf_folder, tmp_path / "q5.gguf", types={"ffn_down": T.Q5_0})
    with pytest.raises(
        ModelLoadError, match=r"blk\.0\.ffn_down\.weight is Q5_0.*--quantization none"
    ):
        _load(tmp_path / "q5.gguf")


def test_a_fused_layer_of_int4_and_int8_blocks_stacks_one_layer_per_type(tiny_gguf, tmp_path):
    _, hf_folder, _ = tiny_gguf
    expected = write_tiny_gguf(hf_folder, tmp_path / "mixed.gguf", types={"attn_v": T.Q8_0})
    qkv = _load(tmp_path / "mixed.gguf").model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, StackedLinear)
    assert [type(p) for p in qkv.parts] == [Int4WeightOnlyLinear, Int8WeightOnlyLinear]
    parts = [expected[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"]
    torch.testing.assert_close(qkv.dequantize(), torch.from_numpy(np.concatenate(parts)))


def test_gguf_mode_needs_a_gguf_file(tiny_gguf):
    _, hf_folder, _ = tiny_gguf
    with pytest.raises(QuantizationError, match="--quantization gguf needs a .gguf model"):
        _load(hf_folder)


def test_auto_loads_q4_q8_blocks_as_they_are_and_anything_else_dequantized(tiny_gguf, tmp_path):
    path, hf_folder, _ = tiny_gguf
    auto = load_model(LoadConfig(model=str(path), device="cpu", cpu_quant_kernel="torch"))
    assert auto.quantization == "gguf" and auto.dtype == torch.float32
    assert auto.model.layers[0].self_attn.qkv_proj.compute_dtype == torch.bfloat16
    write_tiny_gguf(hf_folder, tmp_path / "q5.gguf", types={"ffn_down": T.Q5_0})
    assert loads_as_is(read_gguf(path))
    assert not loads_as_is(read_gguf(tmp_path / "q5.gguf"))  # auto: the dequantized copy


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_default_model_q4_1_as_is_predicts_like_its_dequantized_path(kernel):
    """SmolLM2's Q4_1 projections as int4 layers vs the fp32 dequantization of the same file.
    Exact values are the tiny GGUF tests' job; here: the real file, its tokenizer, and the
    next-token predictions. On the C++ block kernels (auto, where they build) the layers and
    the Q8_0 head compute in fp32: logits within 1e-3 (measured 7e-5); torch's kernels run
    bf16 inputs, which move logits by up to ~1.2: compared loosely."""
    from radixserve.model.quant.block_matmul import resolve_cpu_quant_kernel
    from radixserve.model.tokenizer import load_tokenizer

    cache = CacheConfig(max_total_tokens=512)
    load_config = LoadConfig(device="cpu", cpu_quant_kernel=kernel)
    loaded = load_model(load_config)
    assert loaded.quantization == "gguf"
    assert isinstance(loaded.model.layers[0].mlp.down_proj, Int4WeightOnlyLinear)
    runner = ModelRunner.from_loaded(loaded, load_config, cache)
    tokenizer = load_tokenizer(loaded)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt + "The capital of France is", add_special_tokens=False)
    ours = _logits_of(runner, ids)
    assert tokenizer.decode(ours[-1].argmax()) == " Paris"
    dequantized = ModelRunner.create(LoadConfig(device="cpu", quantization="none"), cache)
    reference = _logits_of(dequantized, ids)
    if resolve_cpu_quant_kernel(kernel) == "blocks":
        torch.testing.assert_close(ours, reference, atol=1e-3, rtol=0)
    agreement = (ours.argmax(dim=-1) == reference.argmax(dim=-1)).float().mean()
    assert agreement > 0.9  # next-token agreement at every position


def _logits_of(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    table = runner.pool.extend_page_table([], len(ids))
    batch = ForwardBatch.build([ids], [0], [table], runner.pool.page_size, return_all_logits=True)
    try:
        return runner.forward(batch).all
    finally:
        runner.pool.allocator.free(table)


@pytest.mark.slow
def test_a_ggufs_tokenizer_comes_from_its_metadata_never_a_dequantized_copy(monkeypatch):
    """What `bench compare` / single_stream build prompts with: an 8B file must not be
    converted to fp32 (32 GB) just to read its vocabulary."""
    from radixserve.model import tokenizer as tokenizer_module
    from radixserve.model.source import default_model_path

    def no_conversion(model):
        raise AssertionError(f"the weights of {model} were converted")

    monkeypatch.setattr(tokenizer_module, "weights_folder", no_conversion)
    tokenizer = tokenizer_module.model_tokenizer(str(default_model_path()))
    assert len(tokenizer) == 49152
    assert tokenizer.decode(tokenizer.encode(" Paris", add_special_tokens=False)) == " Paris"
