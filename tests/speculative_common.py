"""What the speculative decoding tests (tests/test_spec*.py) share: the engine flag that
turns NGRAM speculation on, the tiny model whose greedy output cycles (conftest's
`periodic_model` fixture), a generate call's output ids, an engine's `spec_` counters and
the chi-square statistic the rejection-sampling tests read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import TINY, VOCAB

CYCLE = [1000 + 37 * i for i in range(7)]
NGRAM = {"speculative_algorithm": "NGRAM"}


def save_periodic_model(folder: Path) -> str:
    """A tiny Llama whose next token depends on the current one only (attention and MLP
    outputs zeroed) and whose LM head sends each CYCLE token to the next one."""
    torch.manual_seed(1)
    config = LlamaConfig(**(TINY | {"vocab_size": VOCAB, "max_position_embeddings": 2048}))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for i, token in enumerate(CYCLE):
            model.lm_head.weight[CYCLE[(i + 1) % len(CYCLE)]] = (
                10 * model.model.embed_tokens.weight[token]
            )
    model.save_pretrained(folder)
    return str(folder)


def ids_of(outputs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def spec_stats(engine) -> dict:
    return {k: v for k, v in engine.get_stats().items() if k.startswith("spec_")}


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}
"""The chi-square distribution's 0.999 quantile by degrees of freedom."""


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the draws against `probs` over its support, and its dof."""
    support = torch.nonzero(probs > 0).flatten().tolist()
    counts = np.bincount(tokens, minlength=probs.numel())
    assert counts[[i for i in range(probs.numel()) if i not in support]].sum() == 0
    expected = np.array([probs[i].item() for i in support]) * len(tokens)
    return float(((counts[support] - expected) ** 2 / expected).sum()), len(support) - 1
