"""Loader paths and their errors: HF folders, shards, GGUF, dummy weights, built-in configs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import greedy_generate, make_runner, save_tiny_model
from radixserve.config import LoadConfig, ModelConfig, UnsupportedModelError
from radixserve.model.loader import load_model
from radixserve.model.source import ModelLoadError, builtin_config, builtin_config_names

PROMPT = [[1, 2, 3, 4, 5, 6, 7, 8]]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model(LoadConfig(model=str(missing)))


def test_folder_without_config_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_model(LoadConfig(model=str(tmp_path)))


def test_corrupt_safetensors_names_the_file(tiny_models, tmp_path):
    folder = _copy(tiny_models["llama"], tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(LoadConfig(model=str(folder)))


def test_unknown_architecture_names_it_and_the_supported_list(tiny_models, tmp_path):
    folder = _copy(tiny_models["llama"], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        load_model(LoadConfig(model=str(folder)))


def test_unsupported_rope_type_is_rejected():
    cfg = builtin_config("llama-3-8b") | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_dict(cfg)


def test_missing_tensor_is_named(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_models["llama"], tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(LoadConfig(model=str(folder)))


def test_sharded_checkpoint_loads_like_a_single_file(tiny_models, tmp_path):
    sharded = save_tiny_model("qwen2", tmp_path / "sharded", max_shard_size="50KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single = greedy_generate(make_runner(tiny_models["qwen2"]), PROMPT, 8)
    assert greedy_generate(make_runner(sharded), PROMPT, 8) == single


def test_bf16_load_runs(tiny_models):
    loaded = load_model(LoadConfig(model=str(tiny_models["llama"]), dtype="bfloat16"))
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("name", builtin_config_names())
def test_builtin_configs_parse(name):
    config = ModelConfig.from_hf_dict(builtin_config(name))
    assert config.num_heads % config.num_kv_heads == 0
    assert config.head_dim * config.num_heads >= config.hidden_size // 2


def test_builtin_config_needs_dummy_weights():
    with pytest.raises(ModelLoadError, match="dummy"):
        load_model(LoadConfig(model="llama-3-8b"))


def test_dummy_weights_from_a_builtin_config_run():
    runner = make_runner("smollm2-135m", max_total_tokens=256, load_format="dummy")
    assert runner.config.architecture == "LlamaForCausalLM"
    first = greedy_generate(runner, PROMPT, 4)
    again = make_runner("smollm2-135m", max_total_tokens=256, load_format="dummy")
    assert greedy_generate(again, PROMPT, 4) == first  # seeded


def test_corrupt_gguf_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(LoadConfig(model=str(bad)))
    converted = tmp_path / "cache" / "gguf"
    assert not converted.exists() or not list(converted.iterdir())  # no half-converted folder


def test_wrong_load_format_is_rejected(tiny_models):
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        load_model(LoadConfig(model=str(tiny_models["llama"]), load_format="gguf"))
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model(LoadConfig(model=str(tiny_models["llama"]), load_format="pt"))
