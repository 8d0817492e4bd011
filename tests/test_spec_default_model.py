"""Speculative decoding on the default model (SmolLM2-135M-Instruct, fp32): each algorithm
keeps greedy outputs identical, cold and warm. fp32 because the Q4_1 model's int kernels
compute in bf16, where a 5-row verify may round a near-tie differently from a 1-row decode
(docs/performance.md)."""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.model.source import default_model_path

pytestmark = pytest.mark.slow

MESSAGES = [
    'Copy this exactly: {"city": "Lisbon", "high_c": 21, "low_c": 14, "sky": "sunny"}',
    "Write one sentence about a lighthouse.",
]
GREEDY = {"temperature": 0, "max_new_tokens": 40}
ALGORITHMS = {
    "NGRAM": {"speculative_algorithm": "NGRAM"},
    "SELF": {"speculative_algorithm": "SELF", "speculative_self_layers": 6},
    "STANDALONE": {"speculative_algorithm": "STANDALONE"},  # the model drafting itself
    "EAGLE3": {"speculative_algorithm": "EAGLE3"},  # the head shipped for the default model
}


def _engine(**flags) -> Engine:
    return Engine(quantization="none", max_total_tokens=4096, **flags)


@pytest.fixture(scope="module")
def expected():
    with _engine() as plain:
        prompts = [
            plain.tokenizer.apply_chat_template(
                [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False
            )
            for m in MESSAGES
        ]
        return prompts, [
            o["output_ids"] for o in plain.generate(prompt=prompts, sampling_params=GREEDY)
        ]


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_greedy_outputs_identical_with_speculation(expected, algorithm):
    prompts, ids = expected
    flags = ALGORITHMS[algorithm] | {"speculative_adaptive_threshold": 0}
    if algorithm == "STANDALONE":
        flags["speculative_draft_model_path"] = str(default_model_path())
    with _engine(**flags) as spec:
        initial_free = spec.runner.pool.allocator.num_free
        for _ in range(2):  # cold, then warm
            outputs = spec.generate(prompt=prompts, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outputs] == ids
        assert spec.get_stats()["spec_draft_tokens"] > 0
        spec.check_integrity()
        assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free
