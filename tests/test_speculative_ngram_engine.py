"""NGRAM speculative decoding through the engine on conftest's `periodic_model`, whose greedy
output cycles through 7 tokens, so the n-gram drafter's own drafts are mostly accepted: the
tokens, stops, logprobs and seeded samples are those of plain decoding, a request may opt out,
and the grammar cuts drafts and masks each verify row."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from speculative_common import CYCLE, NGRAM, ids_of, spec_stats

from conftest import VOCAB, greedy, make_engine, prompt_ids


@pytest.mark.parametrize("page_size", [1, 16])
def test_ngram_greedy_matches_plain_decoding_cold_and_warm(periodic_model, page_size):
    prompts = [prompt_ids(i, 40) for i in range(4)]
    plain = make_engine(periodic_model, page_size=page_size)
    spec = make_engine(periodic_model, page_size=page_size, **NGRAM)
    initial_free = spec.runner.pool.allocator.num_free
    expected = ids_of(plain.generate(input_ids=prompts, sampling_params=greedy(45)))
    cold = spec.generate(input_ids=prompts, sampling_params=greedy(45))
    warm = spec.generate(input_ids=prompts, sampling_params=greedy(45))
    assert ids_of(cold) == ids_of(warm) == expected
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in warm)
    stats = spec_stats(spec)
    assert stats["spec_accepted_tokens"] > 0.8 * stats["spec_draft_tokens"] > 0
    assert stats["spec_accept_length"] > 2.5
    assert stats["spec_verify_steps"] < spec.get_stats()["decode_tokens"] / 2
    spec.check_integrity()
    assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free


def test_max_new_tokens_and_stops_are_exact(periodic_model):
    prompt = prompt_ids(3, 40)
    plain = make_engine(periodic_model)
    spec = make_engine(periodic_model, **NGRAM)
    cases = [
        greedy(11),
        greedy(40, stop_token_ids=[CYCLE[5]], ignore_eos=False),
        greedy(40, stop=[plain.tokenizer.decode([CYCLE[2], CYCLE[3]])]),
        greedy(40, min_new_tokens=20, stop_token_ids=[CYCLE[5]], ignore_eos=False),
    ]
    for params, kind in zip(cases, ["length", "stop", "stop", "stop"]):
        expected = plain.generate(input_ids=prompt, sampling_params=params)
        assert expected["meta_info"]["finish_reason"]["type"] == kind
        # a first run fills the n-gram store: the second drafts from its first token on
        for out in [spec.generate(input_ids=prompt, sampling_params=params) for _ in range(2)]:
            assert out["output_ids"] == expected["output_ids"] and out["text"] == expected["text"]
            assert out["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
    assert len(expected["output_ids"]) > 20 and spec_stats(spec)["spec_accepted_tokens"] > 0
    spec.check_integrity()


def test_logprobs_and_penalties_match_plain_decoding(periodic_model):
    prompt = prompt_ids(5, 40)
    params = greedy(30, frequency_penalty=0.3, repetition_penalty=1.1)
    args = dict(input_ids=prompt, return_logprob=True, top_logprobs_num=2,
                token_ids_logprob=CYCLE[:2])  # fmt: skip
    expected = make_engine(periodic_model).generate(sampling_params=params, **args)
    spec = make_engine(periodic_model, **NGRAM)
    spec.generate(input_ids=prompt, sampling_params=greedy(30))  # the store learns the cycle
    out = spec.generate(sampling_params=params, **args)
    assert out["output_ids"] == expected["output_ids"]
    got, want = out["meta_info"], expected["meta_info"]
    assert [t for _, t, _ in got["output_token_logprobs"]] == out["output_ids"]
    assert np.allclose(
        [v for v, _, _ in got["output_token_logprobs"]],
        [v for v, _, _ in want["output_token_logprobs"]],
        atol=1e-4,
    )
    picked = [[e[0] for e in row] for row in got["output_token_ids_logprobs"]]
    assert np.allclose(picked, [[e[0] for e in row] for row in want["output_token_ids_logprobs"]],
                       atol=1e-4)  # fmt: skip
    assert got["spec_draft_token_num"] > 0


def test_logit_bias_bans_a_drafted_token_as_plain_decoding_does(periodic_model):
    """The store drafts the cycle, the banned token among it: each verify row is biased."""
    prompt = prompt_ids(5, 40)
    learnt = make_engine(periodic_model).generate(input_ids=prompt, sampling_params=greedy(30))
    banned = learnt["output_ids"][3]
    params = greedy(30, logit_bias={str(banned): -100})
    expected = make_engine(periodic_model).generate(input_ids=prompt, sampling_params=params)
    spec = make_engine(periodic_model, **NGRAM)
    spec.generate(input_ids=prompt, sampling_params=greedy(30))  # the store learns the cycle
    out = spec.generate(input_ids=prompt, sampling_params=params)
    assert out["output_ids"] == expected["output_ids"] and banned not in out["output_ids"]
    assert out["meta_info"]["spec_draft_token_num"] > 0
    pair = learnt["output_ids"][5:7]  # vLLM's bad words, as ids: a drafted pair never completes
    params = greedy(30, bad_words_ids=[pair])
    expected = make_engine(periodic_model).generate(input_ids=prompt, sampling_params=params)
    out = spec.generate(input_ids=prompt, sampling_params=params)
    ids = out["output_ids"]
    assert ids == expected["output_ids"]
    assert all(ids[i : i + 2] != pair for i in range(len(ids) - 1))


def test_sampling_is_reproducible_and_n_samples_speculate(periodic_model):
    spec = make_engine(periodic_model, **NGRAM)
    params = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 24, "sampling_seed": 7}
    first = spec.generate(input_ids=prompt_ids(1, 40), sampling_params=params)
    again = spec.generate(input_ids=prompt_ids(1, 40), sampling_params=params)
    assert first["output_ids"] == again["output_ids"]
    assert len(first["output_ids"]) == 24 and first["meta_info"]["spec_accept_token_num"] > 0
    many = spec.generate(
        input_ids=prompt_ids(1, 40), sampling_params=params | {"n": 3, "sampling_seed": None}
    )
    assert len(many) == 3 and all(len(o["output_ids"]) == 24 for o in many)
    assert all(o["meta_info"]["spec_verify_ct"] < 23 for o in many)
    spec.check_integrity()


def test_a_request_may_opt_out(periodic_model):
    spec = make_engine(periodic_model, **NGRAM)
    out = spec.generate(input_ids=prompt_ids(2, 40), sampling_params=greedy(30, speculative=False))
    assert not any(key.startswith("spec_") for key in out["meta_info"])
    assert spec_stats(spec)["spec_verify_steps"] == 0
    with pytest.raises(ValueError, match="speculative"):
        spec.generate(input_ids=prompt_ids(2), sampling_params=greedy(3, speculative="no"))
    plain = make_engine(periodic_model)
    assert (
        "spec_verify_ct"
        not in plain.generate(input_ids=prompt_ids(2), sampling_params=greedy(3))["meta_info"]
    )


def test_requests_run_concurrently_with_and_without_speculation(periodic_model):
    spec = make_engine(periodic_model, **NGRAM)

    async def both():
        on = spec.async_generate(input_ids=prompt_ids(6, 40), sampling_params=greedy(30))
        off = spec.async_generate(
            input_ids=prompt_ids(6, 40), sampling_params=greedy(30, speculative=False)
        )
        return await asyncio.gather(on, off)

    on, off = asyncio.run(both())
    assert on["output_ids"] == off["output_ids"]
    assert "spec_verify_ct" in on["meta_info"] and "spec_verify_ct" not in off["meta_info"]


def test_grammar_cuts_drafts_and_masks_each_verify_row(periodic_model):
    engine = make_engine(periodic_model)
    backend = engine.scheduler.grammar
    matcher = backend.matcher(backend.compile_async("regex", "hello world").result())
    ids = engine.tokenizer.encode("hello world", add_special_tokens=False)
    bang = engine.tokenizer.encode("!", add_special_tokens=False)[0]
    assert len(ids) >= 2
    assert backend.valid_draft(matcher, [*ids, bang]) == ids
    assert backend.valid_draft(matcher, [ids[0], bang, ids[1]]) == ids[:1]
    logits = torch.zeros(len(ids) + 1, VOCAB)
    backend.mask_draft_rows(logits, matcher, ids)
    for j, token in enumerate(ids):  # row j allows the j-th token, and not "!"
        assert logits[j, token] == 0 and logits[j, bang] == float("-inf")
    assert torch.isinf(logits[len(ids)]).sum() == VOCAB - len(engine.scheduler.eos_token_ids)
    assert matcher.accept_token(ids[0])  # the matcher is back where it started
