"""Attention logit soft-capping (Gemma's attn_logit_softcapping): a tiny Gemma 3 whose cap
changes transformers' greedy tokens gives transformers' eager tokens through the Engine,
cold and warm (cached prefixes, so cpu_fused's paged_extend and paged_decode both run), on
the reference backend, the C++ one and the Triton one (its kernels under the interpreter).

transformers 5.24's Gemma3Attention keeps `attn_logit_softcapping` but does not hand it to
its attention function (Gemma2Attention does: `softcap=`); the reference here hands it to
transformers' own `eager_attention_forward`, whose soft-capping code is then what we match."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before radixserve_kernels is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402

import conftest  # noqa: E402
from conftest import VOCAB, greedy, hf_greedy, make_engine, save_tiny_model  # noqa: E402

CAP = 0.5
PAGE = 4
PROMPTS = [[(i * 37 + 11 * k) % 256 + 3 for i in range(n)] for k, n in enumerate((29, 9, 41))]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def capped(tmp_path_factory) -> str:
    """conftest's tiny Gemma 3 (window 12, two sliding layers, one global) with its query
    scale raised so that scores reach past the cap."""
    base = conftest.TINY_CONFIGS["gemma3"]

    def config():
        cfg = base()
        cfg.attn_logit_softcapping, cfg.query_pre_attn_scalar = CAP, 1
        return cfg

    conftest.TINY_CONFIGS["gemma3_capped"] = config
    try:
        folder = tmp_path_factory.mktemp("gemma3_capped")
        return str(save_tiny_model("gemma3_capped", folder, vocab_size=VOCAB))
    finally:
        del conftest.TINY_CONFIGS["gemma3_capped"]


def _hf_tokens(folder: str, cap: float | None) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    eager = modeling_gemma3.eager_attention_forward

    def capped_eager(module, *args, **kwargs):
        return eager(module, *args, softcap=cap, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_gemma3, "eager_attention_forward", capped_eager)
        return [hf_greedy(model, p, NUM_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(capped) -> list[list[int]]:
    tokens = _hf_tokens(capped, CAP)
    assert tokens != _hf_tokens(capped, None), "the cap changes no token: the test is blind"
    return tokens


@pytest.mark.parametrize("backend", ["torch_native", "cpu_fused", "triton"])
def test_soft_capped_gemma3_gives_transformers_tokens_cold_and_warm(
    capped, expected, backend, request
):
    if backend == "cpu_fused":
        request.getfixturevalue("cpu_ops")
    if backend == "triton":
        pytest.importorskip("triton")
    engine = make_engine(capped, page_size=PAGE, attention_backend=backend)
    try:
        for round_ in ("cold", "warm"):
            outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy(NUM_TOKENS))
            assert [o["output_ids"] for o in outs] == expected, round_
        assert min(o["meta_info"]["cached_tokens"] for o in outs) >= len(PROMPTS[1]) // PAGE * PAGE
        engine.check_integrity()
    finally:
        engine.shutdown()
