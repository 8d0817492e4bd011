"""SELF (the target's first layers draft) and STANDALONE (a second model drafts): drafts
sampled from a distribution q, verified by the general rejection rule; greedy outputs
identical to plain decoding, sampled tokens distributed as plain sampling's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from speculative_common import CHI2_999, chi_square
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import TINY, VOCAB, greedy, make_engine, prompt_ids
from radixserve.engine.request import Req
from radixserve.engine.speculative import Verifier
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import SamplingBatch, scale_and_filter

"""Chi-square quantiles at p = 0.999 by degrees of freedom."""


def _save_llama(folder, seed: int, num_layers: int, vocab_size: int = VOCAB) -> str:
    torch.manual_seed(seed)
    overrides = {"vocab_size": vocab_size, "max_position_embeddings": 2048}
    config = LlamaConfig(**(TINY | overrides | {"num_hidden_layers": num_layers}))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A 4-layer target, a 2-layer draft with its vocabulary, one with another vocabulary."""
    root = tmp_path_factory.mktemp("draft_models")
    return {
        "target": _save_llama(root / "target", seed=1, num_layers=4),
        "draft": _save_llama(root / "draft", seed=2, num_layers=2),
        "other_vocab": _save_llama(root / "other", seed=2, num_layers=2, vocab_size=VOCAB - 64),
    }


SELF = {"speculative_algorithm": "SELF", "speculative_self_layers": 2}


def _standalone(path: str) -> dict:
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": path}


def _ids(outputs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def _balanced(engine, initial_free: int) -> None:
    engine.check_integrity()
    assert engine.flush_cache() and engine.runner.pool.allocator.num_free == initial_free
    draft_pool = engine.scheduler.drafter.pool
    assert draft_pool.allocator.num_free == draft_pool.allocator.capacity


@pytest.mark.parametrize("algorithm", ["SELF", "STANDALONE", "STANDALONE-same-model"])
def test_draft_models_keep_greedy_outputs_cold_and_warm(models, algorithm):
    prompts = [prompt_ids(i, 20 + 11 * i) for i in range(4)]
    expected = _ids(
        make_engine(models["target"]).generate(input_ids=prompts, sampling_params=greedy(30))
    )
    flags = {
        "SELF": SELF,
        "STANDALONE": _standalone(models["draft"]),
        "STANDALONE-same-model": _standalone(models["target"]),
    }[algorithm]
    spec = make_engine(models["target"], speculative_adaptive_threshold=0, **flags)
    initial_free = spec.runner.pool.allocator.num_free
    cold = spec.generate(input_ids=prompts, sampling_params=greedy(30))
    warm = spec.generate(input_ids=prompts, sampling_params=greedy(30))
    assert _ids(cold) == _ids(warm) == expected
    stats = spec.get_stats()
    assert stats["spec_draft_tokens"] > 0
    if algorithm == "STANDALONE-same-model":  # the target drafting itself: all accepted
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
        assert stats["spec_verify_steps"] <= 2 * 8 * len(prompts)
    _balanced(spec, initial_free)


def test_tiny_pool_retracts_requests_drafting_with_a_model(models):
    prompts = [prompt_ids(i, 24) for i in range(10)]
    expected = _ids(
        make_engine(models["target"]).generate(input_ids=prompts, sampling_params=greedy(60))
    )
    small = make_engine(
        models["target"],
        max_total_tokens=384,
        chunked_prefill_size=64,
        schedule_conservativeness=0.1,
        speculative_adaptive_threshold=0,
        **_standalone(models["target"]),
    )
    initial_free = small.runner.pool.allocator.num_free
    assert _ids(small.generate(input_ids=prompts, sampling_params=greedy(60))) == expected
    assert small.get_stats()["retractions"] > 0 and small.get_stats()["spec_accepted_tokens"] > 0
    _balanced(small, initial_free)


def test_max_new_tokens_and_stops_are_exact_with_a_draft_model(models):
    prompt = prompt_ids(3, 40)
    plain = make_engine(models["target"])
    spec = make_engine(
        models["target"], speculative_adaptive_threshold=0, **_standalone(models["target"])
    )
    reference = plain.generate(input_ids=prompt, sampling_params=greedy(40))["output_ids"]
    stop_text = plain.tokenizer.decode(reference[20:22])
    cases = [
        greedy(11),
        greedy(40, stop_token_ids=[reference[17]], ignore_eos=False),
        greedy(40, stop=[stop_text]),
    ]
    for params in cases:
        expected = plain.generate(input_ids=prompt, sampling_params=params)
        out = spec.generate(input_ids=prompt, sampling_params=params)
        assert out["output_ids"] == expected["output_ids"] and out["text"] == expected["text"]
        assert out["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
    assert spec.get_stats()["spec_accepted_tokens"] > 0


def test_sampled_requests_draft_from_q_and_are_reproducible(models):
    spec = make_engine(models["target"], speculative_adaptive_threshold=0, **SELF)
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 24, "sampling_seed": 7}
    first = spec.generate(input_ids=prompt_ids(1, 40), sampling_params=params)
    again = spec.generate(input_ids=prompt_ids(1, 40), sampling_params=params)
    assert first["output_ids"] == again["output_ids"] and len(first["output_ids"]) == 24
    assert first["meta_info"]["spec_draft_token_num"] > 0


def test_bad_draft_models_fail_at_start_naming_the_flag(models):
    with pytest.raises(ValueError, match="speculative_draft_model_path.*vocabulary"):
        make_engine(models["target"], **_standalone(models["other_vocab"]))
    with pytest.raises(ValueError, match="speculative_self_layers must be below"):
        make_engine(models["target"], speculative_algorithm="SELF", speculative_self_layers=4)


# ---- the general rejection rule's distribution ------------------------------------------------

TARGET_ROWS = (  # a verify row and the bonus row after it, vocab 10
    [3.0, 2.5, 2.0, 1.6, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0],
    [0.3, -1.2, 2.2, 0.1, 1.4, -0.4, 1.9, 0.7, -2.0, 1.1],
)
DRAFT_Q = torch.tensor([0.05, 0.1, 0.3, 0.05, 0.2, 0.1, 0.05, 0.05, 0.05, 0.05])


def _verify_sampled_drafts(num: int = 6000):
    """`num` requests (seeds 0..num-1) verify a one-token draft drawn from DRAFT_Q, at
    temperature 1 and top_p 0.9; returns the outcomes and the target's p of both rows."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)
    rng = np.random.default_rng(0)
    drafts = rng.choice(10, size=num, p=DRAFT_Q.numpy()).tolist()
    reqs = [Req(f"r{i}", [1, 2, 3], params, seed=i) for i in range(num)]
    rows = torch.tensor(TARGET_ROWS).repeat(num, 1)
    q = [DRAFT_Q[None, :]] * num
    results = Verifier(lambda req: []).verify(reqs, [[d] for d in drafts], rows, q)
    batch = SamplingBatch.build([params] * 2, [0, 0], [[], []], [[1, 2, 3]] * 2, [[], []], 10)
    target = scale_and_filter(torch.tensor(TARGET_ROWS), batch, slice(None)).softmax(dim=-1)
    return results, target


def test_tokens_verified_against_a_sampled_draft_follow_the_target_distribution():
    results, target = _verify_sampled_drafts()
    stat, dof = chi_square([r.tokens[0] for r in results], target[0])
    assert stat < CHI2_999[dof], (stat, dof)
    bonus = [r.tokens[1] for r in results if r.num_accepted == 1]
    assert len(bonus) > 1000
    stat, dof = chi_square(bonus, target[1])
    assert stat < CHI2_999[dof], (stat, dof)


def test_resampling_from_p_instead_of_the_residual_fails_the_check(monkeypatch):
    """Power: a rule that accepts with min(1, p/q) but replaces a rejected draft with a draw
    from p (not from max(0, p - q)) over-weights what q favours; the check catches it."""
    from radixserve.engine.speculative import verifier

    def from_p(logits, batch, rows, drafts, q):
        accepted, _ = original(logits, batch, rows, drafts, q)
        noise = verifier.uniform_noise(batch.seeds[rows], batch.steps[rows], batch.vocab_size)
        filtered = verifier.scale_and_filter(logits, batch, rows)
        return accepted, (filtered + verifier.gumbel_from_uniform(noise)).argmax(dim=-1)

    original = verifier._accept_sampled_q
    monkeypatch.setattr(verifier, "_accept_sampled_q", from_p)
    results, target = _verify_sampled_drafts()
    stat, dof = chi_square([r.tokens[0] for r in results], target[0])
    assert stat > CHI2_999[dof]


def test_num_steps_bounds_a_model_draft(models):
    spec = make_engine(
        models["target"],
        speculative_num_steps=2,
        speculative_adaptive_threshold=0,
        **_standalone(models["target"]),
    )
    out = spec.generate(input_ids=prompt_ids(2, 30), sampling_params=greedy(20))
    meta = out["meta_info"]
    assert 0 < meta["spec_draft_token_num"] <= 2 * meta["spec_verify_ct"]
    assert meta["spec_accept_length"] > 2.5  # the target drafting itself: 2 drafts + 1 each
