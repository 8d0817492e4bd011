"""Shared fixtures: tiny seeded random models of each architecture, saved as HF folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from radixserve.config import CacheConfig, LoadConfig  # noqa: E402
from radixserve.model.runner import ModelRunner  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    initializer_range=0.1,
    eos_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=24),
    "qwen2": lambda: Qwen2Config(**TINY),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True),
}


def save_tiny_model(arch: str, folder: Path, seed: int = 0, **save_kwargs) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), dtype=torch.float32).eval()
    model.save_pretrained(folder, **save_kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: save_tiny_model(arch, root / arch) for arch in TINY_CONFIGS}


def make_runner(
    model: Path | str | None,
    page_size: int = 16,
    max_total_tokens: int = 4096,
    load_format: str = "auto",
):
    return ModelRunner.create(
        LoadConfig(
            model=None if model is None else str(model), load_format=load_format, device="cpu"
        ),
        CacheConfig(page_size=page_size, max_total_tokens=max_total_tokens),
    )


def hf_model(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Reference greedy decoding: full recompute each step, no cache, no stop tokens."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
