"""Multi-LoRA serving: two PEFT adapters (random non-zero B) on a tiny random Llama.

Each adapter's greedy tokens equal PEFT's own model, the base equals the plain model, a batch
mixing both adapters and the base gives each its own answer, adapters never share KV, and
bad adapters or requests are refused naming the flag or field.
"""

from __future__ import annotations

import json
import shutil

import pytest
import requests
import torch
from lora_data import NUM_NEW, base_config, build_lora_models, peft_references

from conftest import (
    ServerProcess,
    greedy,
    make_core,
    make_engine,
    prompt_ids,
)
from radixserve.config import LoraConfig, ModelConfig
from radixserve.model.lora import load_lora_weights
from radixserve.model.lora_adapter import LoraAdapterError


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """The base folder and one folder per adapter."""
    return build_lora_models(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def references(lora_models):
    return peft_references(lora_models)


@pytest.fixture(scope="module")
def lora_engine(lora_models):
    base_folder, folders = lora_models
    paths = [f"{name}={folder}" for name, folder in folders.items()]
    engine = make_engine(str(base_folder), lora_paths=paths, max_loras_per_batch=3,
                         max_loaded_loras=3)  # fmt: skip
    yield engine
    engine.shutdown()


def test_adapters_change_the_output(references):
    _, out = references
    assert out[None] != out["a1"] and out[None] != out["a2"] and out["a1"] != out["a2"]


def test_mixed_batch_equals_peft(lora_engine, references):
    """Adapter 1, adapter 2 and the base in one batch, twice over: each PEFT's own tokens."""
    prompts, out = references
    names = [None, "a1", "a2"]
    cases = [(name, i) for i in range(len(prompts)) for name in names]
    results = lora_engine.generate(
        input_ids=[prompts[i] for _, i in cases],
        sampling_params=greedy(NUM_NEW),
        lora_path=[name for name, _ in cases],
    )
    for (name, i), result in zip(cases, results):
        assert result["output_ids"] == out[name][i], (name, i)
    lora_engine.core.check_integrity()


def test_segmented_cpu_kernel_gives_peft_tokens(lora_models, references, cpu_ops, monkeypatch):
    """--cpu-lora-kernel segmented: every LoRA batch's deltas through the C++ segmented op
    (native/csrc/lora_segments.cpp); the mixed batch still gives each PEFT's own tokens."""
    from radixserve.model.lora_segments import LoraKernel

    calls = []
    add = LoraKernel.add
    monkeypatch.setattr(LoraKernel, "add", lambda self, *a: calls.append(1) or add(self, *a))
    base_folder, folders = lora_models
    paths = [f"{name}={folder}" for name, folder in folders.items()]
    engine = make_engine(str(base_folder), lora_paths=paths, cpu_lora_kernel="segmented")
    try:
        prompts, out = references
        cases = [(name, i) for i in range(len(prompts)) for name in (None, "a1", "a2")]
        results = engine.generate(input_ids=[prompts[i] for _, i in cases],
                                  sampling_params=greedy(NUM_NEW),
                                  lora_path=[name for name, _ in cases])  # fmt: skip
        for (name, i), result in zip(cases, results):
            assert result["output_ids"] == out[name][i], (name, i)
        engine.core.check_integrity()
    finally:
        engine.shutdown()
    assert len(calls) >= NUM_NEW * 2 * 4  # decode steps x layers x projections, at least


def test_adapters_never_share_kv(lora_engine, references):
    prompts, out = references
    assert lora_engine.flush_cache()
    prompt = prompts[1]

    def run(name):
        return lora_engine.generate(input_ids=prompt, sampling_params=greedy(NUM_NEW),
                                    lora_path=name)  # fmt: skip

    first = run("a1")
    assert first["meta_info"]["cached_tokens"] == 0
    other = run("a2")  # same prompt, another adapter: nothing of a1's KV
    assert other["meta_info"]["cached_tokens"] == 0 and other["output_ids"] == out["a2"][1]
    base = run(None)
    assert base["meta_info"]["cached_tokens"] == 0 and base["output_ids"] == out[None][1]
    again = run("a1")  # its own KV serves it
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == out["a1"][1]
    lora_engine.core.check_integrity()


def test_unknown_adapter_is_refused(lora_engine):
    with pytest.raises(ValueError, match="lora_path 'nope' is not a loaded LoRA adapter"):
        lora_engine.generate(input_ids=prompt_ids(3), lora_path="nope")
    with pytest.raises(ValueError, match="lora_path has 1 entries for 2 prompts"):
        lora_engine.generate(input_ids=[prompt_ids(3), prompt_ids(4)], lora_path=["a1"])


def test_cache_salt_with_nul_is_refused(lora_engine):
    with pytest.raises(ValueError, match="cache_salt must not contain NUL"):
        lora_engine.generate(input_ids=prompt_ids(3), cache_salt="lora\x00a1")


def test_load_and_unload_while_serving(lora_engine, lora_models, references):
    """A third adapter loaded at run time serves at once; unloaded, it is refused; loaded
    again from another folder, it never meets the KV of its first load."""
    _, folders = lora_models
    prompts, out = references
    assert lora_engine.flush_cache()

    def run(name):
        result = lora_engine.generate(input_ids=prompts[0], sampling_params=greedy(NUM_NEW),
                                      lora_path=name)  # fmt: skip
        return result["output_ids"], result["meta_info"]["cached_tokens"]

    assert run("a1") == (out["a1"][0], 0)
    loaded = lora_engine.load_lora_adapter("a3", str(folders["a1"]))
    assert loaded == {"a1": str(folders["a1"]), "a2": str(folders["a2"]), "a3": str(folders["a1"])}
    assert run("a3") == (out["a1"][0], 0)  # a1's weights, but not a1's KV
    with pytest.raises(ValueError, match=r"'a4': 3 adapters are loaded \(--max-loaded-loras\)"):
        lora_engine.load_lora_adapter("a4", str(folders["a1"]))
    lora_engine.unload_lora_adapter("a3")
    with pytest.raises(ValueError, match="lora_path 'a3' is not a loaded LoRA adapter"):
        run("a3")
    with pytest.raises(ValueError, match="lora_name 'a3' is not loaded"):
        lora_engine.unload_lora_adapter("a3")
    lora_engine.load_lora_adapter("a3", str(folders["a2"]))
    assert run("a3") == (out["a2"][0], 0)  # the first a3's KV is unreachable
    assert run("a3")[1] > 0
    lora_engine.unload_lora_adapter("a3")
    lora_engine.core.check_integrity()


def test_cli_generate_with_an_adapter(lora_engine, lora_models):
    import subprocess
    import sys

    base_folder, folders = lora_models
    prompt = "The adapter says"
    command = [sys.executable, "-m", "radixserve.cli", "generate", prompt, "--model",
               str(base_folder), "--max-new-tokens", str(NUM_NEW), "--max-total-tokens", "4096",
               "--lora-paths", f"a2={folders['a2']}", "--lora-path", "a2"]  # fmt: skip
    printed = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    expected = lora_engine.generate(prompt, greedy(NUM_NEW) | {"ignore_eos": False},
                                    lora_path="a2")["text"]  # fmt: skip
    assert f"### {prompt}\n{expected}\n" in printed


# ---- start-up refusals, naming the flag -----------------------------------------------------


def _model_config(**overrides) -> ModelConfig:
    settings = base_config(**overrides).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    return ModelConfig.from_hf_dict(settings)


def _load(folders, name, config=None, max_rank=None):
    config = config or _model_config()
    return load_lora_weights(config, {name: str(folders[name])}, max_rank, torch.float32,
                             torch.device("cpu"))  # fmt: skip


def test_rank_beyond_the_limit_is_refused(lora_models):
    _, folders = lora_models
    with pytest.raises(LoraAdapterError, match="'a2': rank 8 exceeds --max-lora-rank 4"):
        _load(folders, "a2", max_rank=4)
    assert _load(folders, "a1", max_rank=4).ids == {"a1": 0}


def test_adapter_of_another_base_is_refused(lora_models):
    _, folders = lora_models
    with pytest.raises(LoraAdapterError, match="--lora-paths adapter 'a1'.*another base model"):
        _load(folders, "a1", config=_model_config(hidden_size=32))


def test_unknown_target_module_is_refused(lora_models, tmp_path):
    _, folders = lora_models
    folder = tmp_path / "bad"
    shutil.copytree(folders["a1"], folder)
    settings = json.loads((folder / "adapter_config.json").read_text())
    settings["target_modules"] = ["q_proj", "lm_head"]
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    with pytest.raises(LoraAdapterError, match=r"target modules \['lm_head'\] are not supported"):
        _load({"bad": folder}, "bad")


def test_flag_checks():
    LoraConfig(lora_paths=["a=/x", "b=/y"], max_loras_per_batch=1).verify()  # a pool of 1
    with pytest.raises(ValueError, match="names 3 adapters but --max-loaded-loras is 2"):
        LoraConfig(lora_paths=["a=/x", "b=/y", "c=/z"], max_loras_per_batch=1,
                   max_loaded_loras=2).verify()  # fmt: skip
    with pytest.raises(ValueError, match=r"--max-loaded-loras \(2\) must be at least "):
        LoraConfig(max_loras_per_batch=4, max_loaded_loras=2).verify()
    three = ["a=/x", "b=/y", "c=/z"]  # held adapters are bounded even without the flag
    assert LoraConfig(lora_paths=three, max_loras_per_batch=2).loaded_limit == 3
    assert LoraConfig().loaded_limit == 8 and LoraConfig(max_loaded_loras=9).loaded_limit == 9
    with pytest.raises(ValueError, match="--lora-eviction-policy must be one of lru, fifo"):
        LoraConfig(lora_eviction_policy="random").verify()
    with pytest.raises(ValueError, match="names the adapter 'x' twice"):
        LoraConfig(lora_paths=["x=/a", "/b/x"]).verify()
    with pytest.raises(ValueError, match="--cpu-lora-kernel must be one of auto, segmented, torch"):
        LoraConfig(cpu_lora_kernel="fast").verify()
    bare = LoraConfig(lora_paths=["/some/where/ad1/"])
    assert bare.adapter_paths() == {"ad1": "/some/where/ad1/"}


def other_base_adapter(folder, dest):
    """a1's adapter with every lora_A cut to 32 input columns: an adapter of a narrower base."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(dest / "adapter_model.safetensors")
    cut = {k: (v[:, :32].contiguous() if "lora_A" in k else v) for k, v in tensors.items()}
    save_file(cut, dest / "adapter_model.safetensors")
    return dest


def test_engine_start_refuses_a_bad_adapter(lora_models, tmp_path):
    """Through the engine's start: an adapter of another base, a rank above the flag."""
    base_folder, folders = lora_models
    bad = other_base_adapter(folders["a1"], tmp_path / "bad")
    with pytest.raises(LoraAdapterError, match="--lora-paths adapter 'bad'.*another base model"):
        make_core(str(base_folder), lora_paths=[f"bad={bad}"])
    with pytest.raises(LoraAdapterError, match="'a2': rank 8 exceeds --max-lora-rank 4"):
        make_core(str(base_folder), lora_paths=[f"a2={folders['a2']}"], max_lora_rank=4)


def test_engine_start_refuses_a_missing_folder(lora_models, tmp_path):
    base_folder, _ = lora_models
    with pytest.raises(LoraAdapterError, match="--lora-paths adapter 'gone'.*not found"):
        make_core(str(base_folder), lora_paths=[f"gone={tmp_path / 'gone'}"])


# ---- HTTP: /generate lora_path, OpenAI model -----------------------------------------------


@pytest.fixture(scope="module")
def lora_server(lora_models):
    base_folder, folders = lora_models
    paths = [f"{name}={folder}" for name, folder in folders.items()]
    pool = ["--max-loras-per-batch", "1", "--max-loaded-loras", "3", "--lora-eviction-policy",
            "fifo"]  # fmt: skip
    proc = ServerProcess(str(base_folder), "--served-model-name", "tiny", *pool, "--lora-paths",
                         *paths)  # fmt: skip
    yield proc
    assert proc.stop() == 0


def test_http_lora_path_and_model(lora_server, references):
    prompts, out = references
    url = lora_server.url
    body = {"input_ids": prompts[0], "sampling_params": greedy(NUM_NEW), "lora_path": "a2"}
    reply = requests.post(f"{url}/generate", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["output_ids"] == out["a2"][0]
    completion = {"model": "a1", "prompt": prompts[0], "max_tokens": NUM_NEW, "temperature": 0}
    reply = requests.post(f"{url}/v1/completions", json=completion, timeout=60)
    assert reply.status_code == 200
    assert reply.json()["model"] == "a1"  # the model that answered: the adapter, as SGLang
    tokens = requests.post(f"{url}/generate", json=body | {"lora_path": "a1"}, timeout=60).json()
    assert reply.json()["choices"][0]["text"] == tokens["text"]
    messages = [{"role": "user", "content": "Say something long."}]
    texts = {}
    for model in ("tiny", "a1"):  # Anthropic's Messages: `model` picks the adapter too
        body = {"model": model, "max_tokens": NUM_NEW, "temperature": 0, "messages": messages}
        reply = requests.post(f"{url}/v1/messages", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["model"] == model
        texts[model] = reply.json()["content"][0]["text"]
    assert texts["tiny"] != texts["a1"]
    for model in ("tiny", "a1"):  # and the Responses API's
        body = {"model": model, "input": "Say something long.", "max_output_tokens": NUM_NEW,
                "temperature": 0, "store": False}  # fmt: skip
        reply = requests.post(f"{url}/v1/responses", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["model"] == model, reply.text
        texts[model] = [part["text"] for item in reply.json()["output"]
                        for part in item.get("content", [])]  # fmt: skip
    assert texts["tiny"] != texts["a1"]
    chat = {"model": "a2", "messages": messages, "max_tokens": 2, "stream": True}
    with requests.post(f"{url}/v1/chat/completions", json=chat, stream=True, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]  # fmt: skip
    assert chunks and {chunk["model"] for chunk in chunks} == {"a2"}
    models = requests.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["tiny", "a1", "a2"]
    for card in models:  # OpenAI's GET /v1/models/{model} (it was a 404 for every name)
        retrieved = requests.get(f"{url}/v1/models/{card['id']}", timeout=10).json()
        assert retrieved | {"created": 0} == card | {"created": 0}
    missing = requests.get(f"{url}/v1/models/a9", timeout=10)
    assert missing.status_code == 404 and "a9" in missing.json()["error"]["message"]


def test_http_load_and_unload(lora_server, lora_models, references, tmp_path):
    _, folders = lora_models
    prompts, out = references
    url = lora_server.url
    body = {"lora_name": "a3", "lora_path": str(folders["a2"])}
    reply = requests.post(f"{url}/load_lora_adapter", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["success"]
    assert reply.json()["loaded_adapters"]["a3"] == str(folders["a2"])
    full = {"lora_name": "a4", "lora_path": str(folders["a1"])}
    reply = requests.post(f"{url}/load_lora_adapter", json=full, timeout=60)
    assert reply.status_code == 400 and "--max-loaded-loras" in reply.json()["error_message"]
    gen = {"input_ids": prompts[0], "sampling_params": greedy(NUM_NEW), "lora_path": "a3"}
    assert (
        requests.post(f"{url}/generate", json=gen, timeout=60).json()["output_ids"] == out["a2"][0]
    )
    reply = requests.post(f"{url}/unload_lora_adapter", json={"lora_name": "a3"}, timeout=60)
    assert reply.status_code == 200 and "a3" not in reply.json()["loaded_adapters"]
    assert requests.post(f"{url}/generate", json=gen, timeout=60).status_code == 400
    reply = requests.post(f"{url}/unload_lora_adapter", json={"lora_name": "a3"}, timeout=60)
    assert reply.status_code == 400 and not reply.json()["success"]
    assert "not loaded" in reply.json()["error_message"]
    bad = {"lora_name": "a4", "lora_path": str(folders["a1"] / "missing")}
    reply = requests.post(f"{url}/load_lora_adapter", json=bad, timeout=60)
    assert reply.status_code == 400 and "not found" in reply.json()["error_message"]
    reply = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "a4"}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path"
    bad = {"lora_name": "a4", "lora_path": str(other_base_adapter(folders["a1"], tmp_path / "b"))}
    reply = requests.post(f"{url}/load_lora_adapter", json=bad, timeout=60)
    assert reply.status_code == 400 and "another base model" in reply.json()["error_message"]


def test_http_unknown_adapter(lora_server):
    url = lora_server.url
    body = {"input_ids": prompt_ids(5), "lora_path": "nope"}
    reply = requests.post(f"{url}/generate", json=body, timeout=60)
    assert reply.status_code == 400 and "lora_path" in reply.text
    completion = {"model": "nope", "prompt": "hi", "max_tokens": 2}
    reply = requests.post(f"{url}/v1/completions", json=completion, timeout=60)
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"
