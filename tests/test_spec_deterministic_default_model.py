"""NGRAM, SUFFIX and AUTO on vs off on the default model as it ships (--quantization auto: Q4_1
blocks, int kernels in bf16) under --enable-deterministic-inference, 1 thread, cold and warm cache.

Under the flag every layer is batch-invariant (tests/test_batch_invariance.py), attention
included: cpu_fused runs every query through its extend kernel, whose per-query arithmetic
does not depend on the batch (tests/test_deterministic_attention.py). So NGRAM with 1 and
with 4 draft tokens, SUFFIX and AUTO with 4, give the plain greedy tokens, cold and warm."""

from __future__ import annotations

import pytest
from kernel_checks import torch_threads

from radixserve import Engine

pytestmark = pytest.mark.slow

MESSAGES = [
    'Copy this exactly: {"city": "Lisbon", "high_c": 21, "low_c": 14, "sky": "sunny"}',
    "Print this list again, one item per line: apples, pears, plums, grapes, lemons, limes, "
    "figs, dates.",
]
GREEDY = {"temperature": 0, "max_new_tokens": 40}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def _engine(**flags) -> Engine:
    engine = Engine(max_total_tokens=4096, enable_deterministic_inference=True, **flags)
    if type(engine.runner.attn).__name__ != "CpuFusedBackend":
        engine.shutdown()
        pytest.skip("cpu_fused did not build here; torch_native is not batch-invariant")
    return engine


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    with _engine() as plain:
        return _generate(plain)


def _generate(engine: Engine) -> list[list[int]]:
    """One request at a time (batch 1), so that only speculation changes the batches."""
    outputs = []
    for message in MESSAGES:
        chat = [{"role": "user", "content": message}]
        prompt = engine.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        )
        outputs.append(engine.generate(prompt=prompt, sampling_params=GREEDY)["output_ids"])
    return outputs


def _ngram(num_draft_tokens: int, **flags) -> dict:
    return {
        "speculative_algorithm": "NGRAM",
        "speculative_num_draft_tokens": num_draft_tokens,
        "speculative_adaptive_threshold": 0,
    } | flags


@pytest.mark.parametrize("num_draft_tokens", [1, 4])
def test_ngram_is_identical_cold_and_warm(expected, num_draft_tokens):
    with _engine(**_ngram(num_draft_tokens)) as spec:
        assert _generate(spec) == expected  # cold
        assert _generate(spec) == expected  # warm: the prompts' pages come from the tree
        assert spec.get_stats()["spec_accepted_tokens"] > 0


def test_suffix_is_identical_cold_and_warm(expected):
    """SUFFIX with 4 draft tokens; the warm round also drafts from the first round's outputs."""
    flags = _ngram(4) | {"speculative_algorithm": "SUFFIX"}
    with _engine(**flags) as spec:
        assert _generate(spec) == expected
        assert _generate(spec) == expected
        assert spec.get_stats()["spec_accepted_tokens"] > 0


def test_auto_is_identical_cold_and_warm(expected):
    """AUTO with 4 draft tokens: NGRAM or SUFFIX, picked per request and step."""
    flags = _ngram(4) | {"speculative_algorithm": "AUTO"}
    with _engine(**flags) as spec:
        assert _generate(spec) == expected
        assert _generate(spec) == expected
        assert spec.get_stats()["spec_accepted_tokens"] > 0
