"""GPTQ and AWQ checkpoints: tiny random models quantized and packed here with each format's
published rules (a packer of its own, word by word, not our loader inverted), saved as HF
folders with a `quantization_config`, and loaded through the public path.

Tolerances: in float32 a loaded layer's weight is the packer's dequantized weight up to the
int4 kernel's own fp32 reading (1e-6); in bfloat16 (what --dtype auto picks) its scales and
zeros are rounded to bf16's 8-bit mantissa: within max|w| / 32. Logits of the fp32 model
against a fp32 twin holding the dequantized weights: 2e-4, as in test_quantization.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import SYSTEM, greedy, make_engine, prompt_ids
from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.loader import load_model
from radixserve.model.quant.linear import Int4WeightOnlyLinear
from radixserve.model.quant.quantize import QuantizationError
from radixserve.model.runner import ModelRunner
from radixserve.model.source import ModelLoadError

# (method, sym, group size, architecture): qwen2 adds q/k/v biases
CASES = {
    "gptq-sym": ("gptq", True, 64, "llama"),
    "gptq-asym": ("gptq", False, 32, "qwen2"),
    "awq": ("awq", False, 32, "llama"),
    "awq-g64-bias": ("awq", False, 64, "qwen2"),
}
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ gemm: nibble j holds column 8c + this[j]
FUSED = {  # our fused projection -> HF parts, in row order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
HF_PARTS = [part.split(".")[1] for parts in FUSED.values() for part in parts]
PROMPTS = [[1, 5, 7, 9, 11, 3, 4, 100, 200, 17, 18, 19, 20, 21, 22, 23, 40], [3, 4, 5]]
MODEL_TOL = dict(atol=2e-4, rtol=0)


# ---- the test's own quantizer and packers --------------------------------------------------


def quantize_groups(weight: torch.Tensor, group_size: int, method: str, sym: bool):
    """[out, in] -> codes [out, in] 0..15, fp16 scales and integer zeros [out, groups], by
    GPTQ's min/max rule (the range always spans 0; sym: zero 8) or AWQ's (group min/max)."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    if method == "gptq":
        low, high = low.clamp(max=0), high.clamp(min=0)
        if sym:
            high = torch.maximum(-low, high)
            low = -high
    scales = ((high - low) / 15).clamp(min=1e-5).half()
    s = scales.float()
    zeros = torch.full_like(s, 8) if sym else torch.round(-low / s).clamp(0, 15)
    codes = (torch.round(groups / s[..., None]) + zeros[..., None]).clamp(0, 15)
    return codes.reshape(out_features, in_features).int(), scales, zeros.int()


def dequantize(codes, scales, zeros, group_size: int) -> torch.Tensor:
    """w = (q - zero) * scale, in fp32: what both formats mean by their tensors."""
    scale = scales.float().repeat_interleave(group_size, dim=1)
    zero = zeros.float().repeat_interleave(group_size, dim=1)
    return (codes.float() - zero) * scale


def pack_rows(values: np.ndarray) -> np.ndarray:
    """GPTQ qweight: [in, out] -> [in / 8, out]; word r holds rows 8r + j in nibble j."""
    packed = np.zeros((values.shape[0] // 8, values.shape[1]), dtype=np.uint32)
    for r in range(packed.shape[0]):
        for j in range(8):
            packed[r] |= values[8 * r + j].astype(np.uint32) << np.uint32(4 * j)
    return packed.view(np.int32)


def pack_columns(values: np.ndarray, order: list[int]) -> np.ndarray:
    """[rows, cols] -> [rows, cols / 8]; word c holds column 8c + order[j] in nibble j."""
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for c in range(packed.shape[1]):
        for j in range(8):
            packed[:, c] |= values[:, 8 * c + order[j]].astype(np.uint32) << np.uint32(4 * j)
    return packed.view(np.int32)


def packed_tensors(method: str, codes, scales, zeros, group_size: int) -> dict[str, torch.Tensor]:
    """One projection's checkpoint tensors (codes [out, in], zeros [out, groups])."""
    codes_t, zeros_t = codes.t().numpy(), zeros.t().numpy()  # [in, out], [groups, out]
    if method == "gptq":  # v1 format: the stored zero is zero - 1, as a nibble
        in_features = codes.shape[1]
        return {
            "qweight": torch.from_numpy(pack_rows(codes_t)),
            "qzeros": torch.from_numpy(pack_columns((zeros_t - 1) & 0xF, list(range(8)))),
            "scales": scales.t().contiguous(),
            "g_idx": torch.arange(in_features, dtype=torch.int32) // group_size,
        }
    return {
        "qweight": torch.from_numpy(pack_columns(codes_t, AWQ_PACK_ORDER)),
        "qzeros": torch.from_numpy(pack_columns(zeros_t, AWQ_PACK_ORDER)),
        "scales": scales.t().contiguous(),
    }


def quant_config(method: str, sym: bool, group_size: int) -> dict:
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": False,
            "sym": sym,
            "checkpoint_format": "gptq",
        }
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }


def write_checkpoint(fp_folder: Path, folder: Path, twin: Path, case: tuple) -> dict:
    """Writes the packed checkpoint (fp16 for the rest, as these formats ship) and its fp32
    twin holding the dequantized weights; returns the dequantized weight of each projection."""
    method, sym, group_size, _ = case
    packed, dense, reference = {}, {}, {}
    for name, weight in load_file(fp_folder / "model.safetensors").items():
        module, kind = name.rsplit(".", 1)
        if kind == "weight" and module.split(".")[-1] in HF_PARTS:
            codes, scales, zeros = quantize_groups(weight, group_size, method, sym)
            parts = packed_tensors(method, codes, scales, zeros, group_size)
            packed |= {f"{module}.{k}": v for k, v in parts.items()}
            reference[module] = dense[name] = dequantize(codes, scales, zeros, group_size)
        else:
            packed[name] = weight.half()
            dense[name] = weight.half().float()
    config = json.loads((fp_folder / "config.json").read_text())
    for out, tensors, extra in [(folder, packed, quant_config(*case[:3])), (twin, dense, None)]:
        out.mkdir()
        save_file(tensors, out / "model.safetensors")
        cfg = config | ({"quantization_config": extra} if extra else {})
        (out / "config.json").write_text(json.dumps(cfg))
    return reference


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> dict[str, tuple[Path, Path, dict]]:
    """case -> (packed folder, fp32 twin folder, dequantized weight per projection)."""
    root = tmp_path_factory.mktemp("gptq_awq")
    made = {}
    for name, case in CASES.items():
        folder, twin = root / name, root / f"{name}-twin"
        made[name] = (folder, twin, write_checkpoint(tiny_models[case[3]], folder, twin, case))
    return made


def _load(folder: Path, **kwargs):
    return load_model(LoadConfig(model=str(folder), **({"device": "cpu"} | kwargs)))


def _logits(runner: ModelRunner) -> torch.Tensor:
    tables = [runner.pool.extend_page_table([], len(p)) for p in PROMPTS]
    batch = ForwardBatch.build(PROMPTS, [0] * len(PROMPTS), tables, 16, return_all_logits=True)
    return runner.forward(batch).all


# ---- (a) each layer's weight, (b) the model's logits ------------------------------------------


@pytest.mark.parametrize(("dtype", "tight"), [("float32", True), ("auto", False)])
@pytest.mark.parametrize("case", CASES)
def test_layers_hold_the_packers_dequantized_weights(checkpoints, case, dtype, tight):
    folder, _, reference = checkpoints[case]
    loaded = _load(folder, dtype=dtype)  # --quantization auto: picked from config.json
    assert loaded.quantization == CASES[case][0]
    assert loaded.dtype == torch.float32  # auto on CPU: an fp32 model with bf16 int kernels
    fp16 = load_file(folder / "model.safetensors")
    for i, layer in enumerate(loaded.model.layers):
        for path, parts in FUSED.items():
            owner, attr = path.split(".")
            module = getattr(getattr(layer, owner), attr)
            assert isinstance(module, Int4WeightOnlyLinear)
            assert module.compute_dtype == (torch.float32 if tight else torch.bfloat16)
            expected = torch.cat([reference[f"model.layers.{i}.{p}"] for p in parts])
            atol = 1e-6 if tight else expected.abs().max().item() / 32
            torch.testing.assert_close(module.dequantize().float(), expected, atol=atol, rtol=0)
            biases = [fp16.get(f"model.layers.{i}.{p}.bias") for p in parts]
            if biases[0] is None:
                assert module.bias is None
            else:
                assert torch.equal(module.bias.float(), torch.cat(biases).float())


@pytest.mark.parametrize("case", CASES)
def test_logits_match_the_dequantized_fp32_twin(checkpoints, case):
    folder, twin, _ = checkpoints[case]
    cache = CacheConfig(max_total_tokens=1024)
    packed = ModelRunner.create(LoadConfig(str(folder), device="cpu", dtype="float32"), cache)
    dense = ModelRunner.create(LoadConfig(str(twin), device="cpu", dtype="float32"), cache)
    torch.testing.assert_close(_logits(packed), _logits(dense), **MODEL_TOL)


# ---- (c) the engine: greedy generation, radix cache cold vs warm ------------------------------


def test_engine_generates_and_the_radix_cache_is_exact(tiny_chat_model, tmp_path):
    """A GPTQ (asym) SmolLM2-vocabulary model through Engine's defaults (auto, bf16); batch-
    invariant, so that cold (a big prefill: dense) and warm (kernel) runs round alike."""
    folder = tmp_path / "gptq"
    write_checkpoint(Path(tiny_chat_model), folder, tmp_path / "twin", CASES["gptq-asym"])
    prompts = [SYSTEM + prompt_ids(i, 20) for i in range(3)]
    engine = make_engine(str(folder), enable_deterministic_inference=True)
    cold = engine.generate(input_ids=prompts, sampling_params=greedy(10))
    warm = engine.generate(input_ids=prompts, sampling_params=greedy(10))
    engine.shutdown()
    for c, w in zip(cold, warm):
        assert len(c["output_ids"]) == 10
        assert c["output_ids"] == w["output_ids"]
        assert w["meta_info"]["cached_tokens"] > 0


# ---- (d) what is refused at start, naming the option ------------------------------------------


def _variant(checkpoints, tmp_path, case: str, **options) -> Path:
    """A copy of a case's folder whose quantization_config has `options` changed."""
    source = checkpoints[case][0]
    folder = tmp_path / "variant"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] |= options
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("case", "options", "message"),
    [
        ("gptq-sym", {"desc_act": True}, "desc_act=true"),
        ("gptq-asym", {"bits": 8}, "bits=8"),
        ("awq", {"bits": 3}, "bits=3"),
        ("gptq-sym", {"group_size": -1}, "group_size=-1"),
        ("gptq-sym", {"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ("awq", {"version": "gemv"}, "version='gemv'"),
        ("awq", {"zero_point": False}, "zero_point=False"),
        ("awq", {"quant_method": "bitsandbytes"}, "quant_method is 'bitsandbytes'"),
    ],
)
def test_unsupported_checkpoint_options_are_named(checkpoints, tmp_path, case, options, message):
    with pytest.raises(QuantizationError, match=message):
        _load(_variant(checkpoints, tmp_path, case, **options))


@pytest.mark.parametrize(
    ("case", "kwargs", "message"),
    [
        ("gptq-sym", {"quantization": "int8"}, "--quantization int8 cannot apply to this gptq"),
        ("awq", {"quantization": "none"}, "--quantization none cannot apply to this awq"),
        ("awq", {"quantization": "gptq"}, "--quantization gptq needs .* this one has 'awq'"),
        ("gptq-sym", {"quantization_group_size": 32}, "--quantization-group-size applies"),
        ("gptq-sym", {"device": "cuda"}, "--quantization gptq runs on CPU only"),
        ("awq", {"load_format": "dummy"}, "--load-format dummy cannot fill .* awq checkpoint"),
    ],
)
def test_bad_flags_on_a_packed_checkpoint_are_named(checkpoints, case, kwargs, message):
    with pytest.raises(QuantizationError, match=message):
        _load(checkpoints[case][0], **kwargs)


def test_gptq_flag_on_a_plain_checkpoint_is_named(tiny_models):
    with pytest.raises(QuantizationError, match="--quantization gptq needs .* has None"):
        _load(tiny_models["llama"], quantization="gptq")


def test_act_order_g_idx_is_refused_naming_desc_act(checkpoints, tmp_path):
    folder = _variant(checkpoints, tmp_path, "gptq-asym")  # two groups of 32 per row
    tensors = load_file(folder / "model.safetensors")
    g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
    tensors["model.layers.0.self_attn.q_proj.g_idx"] = g_idx.flip(0).contiguous()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QuantizationError, match="q_proj.g_idx regroups .* desc_act=false"):
        _load(folder)


def _with_biases(checkpoints, tmp_path, value: float) -> Path:
    """The gptq-sym (llama, no biases) folder with a bias of `value` in every projection."""
    folder = _variant(checkpoints, tmp_path, "gptq-sym")
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".scales")]:
        out_features = tensors[name].shape[1]
        tensors[name.replace(".scales", ".bias")] = torch.full((out_features,), value).half()
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_all_zero_biases_of_a_bias_free_model_are_dropped(checkpoints, tmp_path):
    loaded = _load(_with_biases(checkpoints, tmp_path, 0.0))
    assert all(layer.self_attn.qkv_proj.bias is None for layer in loaded.model.layers)


def test_a_bias_the_model_config_lacks_is_an_error(checkpoints, tmp_path):
    with pytest.raises(ModelLoadError, match="has a bias the model config does not declare"):
        _load(_with_biases(checkpoints, tmp_path, 0.5))


def test_cli_takes_gptq_and_awq_and_defaults_to_auto():
    from radixserve.cli import build_parser

    assert build_parser().parse_args(["generate", "hi"]).quantization == "auto"
    args = build_parser().parse_args(["generate", "hi", "--quantization", "awq"])
    assert args.quantization == "awq"
