"""NGRAM on vs off on the default model as it ships (--quantization auto: Q4_1 blocks, int
kernels in bf16) under --enable-deterministic-inference, 1 thread, cold cache.

Every layer but attention is batch-invariant under the flag (tests/test_batch_invariance.py).
Attention is for verifies of up to 2 tokens: cpu_fused runs them through its decode kernel,
so K = 1 is identical as shipped. Longer verifies run SDPA, which rounds differently from
the decode kernel (docs/performance.md): with a row-wise attention swapped in, K = 4 is
identical too, cold and warm, which is what a batch-invariant extend kernel must give."""

from __future__ import annotations

import pytest
import torch
from test_batch_invariance import row_wise_attention

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
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine(reference_attention: bool = False, **flags) -> Engine:
    engine = Engine(max_total_tokens=4096, enable_deterministic_inference=True, **flags)
    if reference_attention:
        engine.runner.attn.forward = row_wise_attention(engine.runner)
    return engine


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


def test_ngram_with_one_draft_token_is_identical_as_shipped():
    with _engine() as plain:
        if type(plain.runner.attn).__name__ != "CpuFusedBackend":
            pytest.skip("cpu_fused did not build here; torch_native verifies 2 rows by SDPA")
        expected = _generate(plain)
    with _engine(**_ngram(1)) as spec:
        assert _generate(spec) == expected
        assert spec.get_stats()["spec_accepted_tokens"] > 0


def test_ngram_is_identical_cold_and_warm_with_a_row_wise_attention():
    with _engine(reference_attention=True) as plain:
        expected = _generate(plain)
    with _engine(reference_attention=True, **_ngram(4)) as spec:
        assert _generate(spec) == expected  # cold
        assert _generate(spec) == expected  # warm: the prompts' pages come from the tree
        assert spec.get_stats()["spec_accepted_tokens"] > 0
