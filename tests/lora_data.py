"""Two PEFT LoRA adapters (random non-zero B) on a tiny random Llama, and PEFT's own greedy
tokens for them: what test_lora.py and test_lora_speculative.py serve and check against."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import TINY, VOCAB, hf_greedy, hf_model, prompt_ids

NUM_NEW = 8
ADAPTERS = {  # name -> (target modules, r, lora_alpha, use_rslora)
    "a1": (["q_proj", "k_proj", "v_proj", "o_proj"], 4, 8, False),
    "a2": (["q_proj", "gate_proj", "up_proj", "down_proj"], 8, 16, True),
}


def base_config(**overrides) -> LlamaConfig:
    settings = TINY | {"vocab_size": VOCAB, "max_position_embeddings": 2048}
    return LlamaConfig(**(settings | overrides))


def save_adapter(base_folder, folder, targets, rank, alpha, rslora, seed) -> None:
    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0
    )
    lora_model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    for name, param in lora_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: make the adapter change the output
            param.data = torch.randn(param.shape, generator=generator) * 0.3
    lora_model.save_pretrained(folder)


def build_lora_models(root: Path) -> tuple[Path, dict[str, Path]]:
    """The base folder and one folder per adapter, under `root`."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(base_config(), dtype=torch.float32)
    base.save_pretrained(root / "base")
    folders = {}
    for seed, (name, (targets, rank, alpha, rslora)) in enumerate(ADAPTERS.items()):
        folders[name] = root / name
        save_adapter(root / "base", folders[name], targets, rank, alpha, rslora, seed + 1)
    return root / "base", folders


def peft_references(lora_models) -> tuple[list[list[int]], dict[str | None, list[list[int]]]]:
    """PEFT's greedy tokens per adapter (None: the plain model) for two prompts."""
    base_folder, folders = lora_models
    prompts = [prompt_ids(1, 20), prompt_ids(2, 35)]
    plain = hf_model(base_folder)
    out = {None: [hf_greedy(plain, p, NUM_NEW) for p in prompts]}
    for name, folder in folders.items():
        model = peft.PeftModel.from_pretrained(hf_model(base_folder), folder).eval()
        out[name] = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    return prompts, out
