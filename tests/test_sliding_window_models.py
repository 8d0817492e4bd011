"""Sliding-window and hybrid models (Gemma 3, Qwen2 with use_sliding_window) through the Engine:
greedy tokens equal transformers' on prompts longer than the window, cold and warm cache,
chunked prefill, retraction under a tiny pool, and an agent workload whose multi-turn
histories outgrow the window; the cache's integrity holds afterwards."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, greedy, hf_model, make_engine, save_tiny_model
from radixserve.config import ModelConfig
from radixserve.config.model import UnsupportedModelError
from radixserve.model.source import builtin_config

ARCHS = ["gemma3", "qwen2_swa"]  # tiny configs in conftest: a 12-token window
PROMPTS = [
    [(i * 37 + 5) % 256 for i in range(41)],
    [3, 4, 5, 6, 7],
    [(i * 11 + 1) % 256 for i in range(26)],
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """conftest's tiny configs with SmolLM2's vocabulary (the Engine borrows its tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    return {arch: str(save_tiny_model(arch, root / arch, vocab_size=VOCAB)) for arch in ARCHS}


@pytest.fixture(scope="module")
def expected(tiny_models) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens for PROMPTS, per architecture."""
    out = {}
    for arch in ARCHS:
        reference = hf_model(tiny_models[arch])
        out[arch] = [_hf_greedy_cached(reference, p, NEW_TOKENS) for p in PROMPTS]
    return out


@torch.inference_mode()
def _hf_greedy_cached(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy decoding through its own (sliding-window) KV cache: conftest's
    full-recompute reference costs a forward of the whole sequence per token."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < num_tokens:
        ids = torch.tensor([[tokens[-1]]])
        out = model(ids, cache=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.fixture(scope="module")
def engines(tiny_models):
    """One engine per architecture with page size 4 (the window spans three pages)."""
    return {arch: make_engine(tiny_models[arch], page_size=4) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_cold_and_warm_match_transformers(engines, expected, arch):
    engine = engines[arch]
    engine.flush_cache()
    cold = engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    warm = engine.generate(input_ids=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    assert [o["output_ids"] for o in cold] == expected[arch]
    assert [o["output_ids"] for o in warm] == expected[arch]
    assert warm[0]["meta_info"]["cached_tokens"] == 40  # all but the last prompt token
    engine.check_integrity()


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_retraction_under_a_tiny_pool(engines, tiny_models, arch):
    """8-token prefill chunks and a 128-token pool that retracts: the tokens of the
    module's roomy engine (which matches transformers above)."""
    prompts = [[(i * 37 + 5 * k) % 256 for i in range(14 + 3 * k)] for k in range(8)]
    roomy = engines[arch].generate(input_ids=prompts, sampling_params=greedy(48))
    engine = make_engine(
        tiny_models[arch], page_size=4, max_total_tokens=128, chunked_prefill_size=8
    )
    initial_free = engine.runner.pool.allocator.num_free
    out = engine.generate(input_ids=prompts, sampling_params=greedy(48))
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in roomy]
    assert engine.get_stats()["retractions"] > 0
    engine.check_integrity()
    assert engine.flush_cache()
    assert engine.runner.pool.allocator.num_free == initial_free
    engines[arch].check_integrity()


@pytest.mark.parametrize("arch", ARCHS)
def test_agent_turns_longer_than_the_window_hit_the_cache(engines, tiny_models, arch):
    """A long shared system prompt, then two turns per conversation, each history far past
    the 12-token window: later turns are served from the cache and equal a cold run's."""
    system = [(i * 7 + 3) % 256 for i in range(48)]
    engine = engines[arch]
    engine.flush_cache()
    histories = [system + [(c * 31 + j) % 256 for j in range(9)] for c in range(3)]
    cached = []
    for turn in range(2):
        outs = engine.generate(input_ids=histories, sampling_params=greedy(10))
        cached += [o["meta_info"]["cached_tokens"] for o in outs]
        histories = [
            h + o["output_ids"] + [(turn * 13 + 2) % 256] * 5 for h, o in zip(histories, outs)
        ]
    assert min(cached[1:]) >= 48 and min(cached[3:]) >= 48 + 9 + 10 - 4
    cold = make_engine(tiny_models[arch], page_size=4, disable_radix_cache=True)
    warm = engine.generate(input_ids=histories, sampling_params=greedy(10))
    assert [o["output_ids"] for o in warm] == [
        o["output_ids"] for o in cold.generate(input_ids=histories, sampling_params=greedy(10))
    ]
    assert min(o["meta_info"]["cached_tokens"] for o in warm) > 0
    engine.check_integrity()


def test_window_layers_follow_transformers_config_rules():
    """Which layers slide: Gemma 3's pattern (built-in gemma-3-4b: every sixth is global),
    Qwen2's max_window_layers; options nothing here computes are refused, naming them."""
    gemma = ModelConfig.from_hf_dict(builtin_config("gemma-3-4b"))
    assert gemma.sliding_window == 1024 and gemma.is_hybrid
    assert [i for i in range(34) if gemma.layer_window(i) is None] == [5, 11, 17, 23, 29]
    assert gemma.gemma.local_rope_theta == 10000.0 and gemma.rope_scaling["factor"] == 8.0
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "vocab_size": 8,
             "hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2}  # fmt: skip
    swa = ModelConfig.from_hf_dict(qwen2 | {"use_sliding_window": True, "max_window_layers": 3})
    assert swa.layer_windows() == (None, None, None, 4096)
    assert ModelConfig.from_hf_dict(qwen2 | {"sliding_window": 64}).sliding_layers == ()
    unset = qwen2 | {"use_sliding_window": True, "sliding_window": None}
    assert ModelConfig.from_hf_dict(unset).layer_windows() == (None,) * 4
    capped = ModelConfig.from_hf_dict(builtin_config("gemma-3-4b") | {"attn_logit_softcapping": 50})
    assert capped.attn_logit_cap == 50 and gemma.attn_logit_cap is None
    for option, value in (("attn_logit_softcapping", 0.0), ("use_bidirectional_attention", 1)):
        with pytest.raises(UnsupportedModelError, match=option):
            ModelConfig.from_hf_dict(builtin_config("gemma-3-4b") | {option: value})
    moe = qwen2 | {"architectures": ["Qwen2MoeForCausalLM"], "use_sliding_window": True}
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(moe | {"num_experts": 2, "num_experts_per_tok": 1})
