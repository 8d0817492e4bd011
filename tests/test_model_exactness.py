"""Our Llama-family implementation against transformers on tiny random models (fp32)."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_CONFIGS, greedy_generate, hf_greedy, hf_model, make_runner
from radixserve.forward_batch import ForwardBatch

# Lengths chosen to cross page boundaries and Mistral's 24-token sliding window.
PROMPTS = [
    [1, 5, 7, 9, 11, 3, 4, 100, 200, 17, 18, 19, 20, 21, 22, 23, 40],
    [3, 4, 5],
    [(i * 37) % 256 for i in range(30)],
]


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_greedy_tokens_match_transformers(tiny_models, arch):
    runner = make_runner(tiny_models[arch])
    ours = greedy_generate(runner, PROMPTS, max_new_tokens=32)
    reference = hf_model(tiny_models[arch])
    for prompt, tokens in zip(PROMPTS, ours):
        assert tokens == hf_greedy(reference, prompt, 32)
    assert runner.pool.allocator.num_free == runner.pool.allocator.capacity


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_logits_match_transformers(tiny_models, arch):
    runner = make_runner(tiny_models[arch])
    reference = hf_model(tiny_models[arch])
    tables = [runner.pool.extend_page_table([], len(p)) for p in PROMPTS]
    batch = ForwardBatch.build(PROMPTS, [0, 0, 0], tables, 16, return_all_logits=True)
    out = runner.forward(batch)
    offset = 0
    for i, prompt in enumerate(PROMPTS):
        with torch.inference_mode():
            expected = reference(torch.tensor([prompt])).logits[0]
        assert expected.abs().max() > 0.5  # the comparison is not between near-zero logits
        torch.testing.assert_close(out.last[i], expected[-1], atol=1e-4, rtol=0)
        torch.testing.assert_close(
            out.all[offset : offset + len(prompt)], expected, atol=1e-4, rtol=0
        )
        offset += len(prompt)
