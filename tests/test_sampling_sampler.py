"""The vectorized seeded sampler: greedy and seeded draws (independent of the batch's other
rows), top-k / top-p / min-p filters and temperature, penalties and min_new_tokens, and the
logprobs it reports."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.sampling import SamplingBatch, SamplingParams, sample, token_logprobs, top_logprobs
from radixserve.sampling.sampler import apply_penalties, banned_next, is_plain_argmax

V = 32


def make_batch(
    params: list[SamplingParams],
    seeds: list[int] | None = None,
    output_ids: list[list[int]] | None = None,
    prompt_ids: list[list[int]] | None = None,
    stop_ids: list[list[int]] | None = None,
    vocab_size: int = V,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds if seeds is not None else list(range(n)),
        output_ids if output_ids is not None else [[] for _ in range(n)],
        prompt_ids if prompt_ids is not None else [[] for _ in range(n)],
        stop_ids if stop_ids is not None else [[] for _ in range(n)],
        vocab_size,
        "cpu",
    )


def draw(logits: torch.Tensor, params: SamplingParams, seed: int = 0, step: int = 0) -> int:
    """One request sampled alone at a given step (steps = len(output_ids))."""
    batch = make_batch([params], [seed], output_ids=[[0] * step])
    return int(sample(logits[None], batch)[0])


def random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---- greedy and seeded draws -----------------------------------------------------------------


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 1.5) for i in range(6)]
    out = sample(logits, make_batch(params))
    assert out.dtype == torch.int64 and out.shape == (6,)
    for i in range(0, 6, 2):
        assert out[i] == logits[i].argmax()


def test_sample_does_not_modify_logits():
    logits = random_logits(3)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, min_new_tokens=2)] * 3
    batch = make_batch(params, output_ids=[[1, 2]] * 3, prompt_ids=[[3]] * 3, stop_ids=[[4]] * 3)
    sample(logits, batch)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "target",
    [SamplingParams(temperature=1.3, top_p=0.9, min_p=0.01), SamplingParams(temperature=0.8)],
)
def test_seeded_draw_is_independent_of_batch_company(target):
    target_logits = random_logits(1, seed=1)[0]
    for seed, step in [(7, 0), (7, 5), (123456789, 3), (2**63 + 5, 1)]:
        alone = draw(target_logits, target, seed, step)
        for position in (0, 17, 49):
            logits = random_logits(50, seed=seed % 1000 + position)
            params = [
                SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.2)
                if i % 3
                else SamplingParams(temperature=0)
                for i in range(50)
            ]
            seeds = [1000 + i for i in range(50)]
            outputs = [[i % V] * (i % 4) for i in range(50)]
            logits[position], params[position] = target_logits, target
            seeds[position], outputs[position] = seed, [0] * step
            out = sample(logits, make_batch(params, seeds, outputs))
            assert int(out[position]) == alone, (seed, step, position)


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, V)  # uniform: any seed dependence shows up
    tokens = {draw(logits[0], SamplingParams(), seed=s) for s in range(200)}
    assert len(tokens) > V // 2


def test_same_seed_different_steps_vary():
    logits = torch.zeros(V)
    tokens = {draw(logits, SamplingParams(), seed=3, step=t) for t in range(200)}
    assert len(tokens) > V // 2


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    probs = logits.softmax(-1)
    num_draws = 4000
    # One batch of 4000 rows: the same request at steps 0..3999.
    batch = SamplingBatch.build(
        [SamplingParams()] * num_draws,
        [42] * num_draws,
        [[0] * t for t in range(num_draws)],
        [[] for _ in range(num_draws)],
        [[] for _ in range(num_draws)],
        4,
        "cpu",
    )
    out = sample(logits.expand(num_draws, 4), batch)
    counts = torch.bincount(out, minlength=4).double()
    expected = probs.double() * num_draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom
    assert torch.allclose(counts / num_draws, probs.double(), atol=0.03)


# ---- filters and temperature -----------------------------------------------------------------


def sampled_tokens(logits: torch.Tensor, params: SamplingParams, trials: int = 300) -> list[int]:
    batch = make_batch([params] * trials, list(range(trials)), vocab_size=logits.shape[-1])
    return sample(logits.expand(trials, -1), batch).tolist()


def test_top_k_one_equals_greedy():
    logits = random_logits(8)
    greedy = sample(logits, make_batch([SamplingParams(temperature=0)] * 8))
    top1 = sample(logits, make_batch([SamplingParams(temperature=2.0, top_k=1)] * 8))
    assert torch.equal(greedy, top1)
    assert torch.equal(greedy, logits.argmax(-1))


def test_top_k_keeps_only_k_best():
    logits = random_logits(1, seed=3)[0]
    best3 = set(logits.topk(3).indices.tolist())
    tokens = set(sampled_tokens(logits, SamplingParams(temperature=5.0, top_k=3)))
    assert tokens == best3


def test_tiny_top_p_keeps_only_the_max():
    logits = random_logits(1, seed=4)[0]
    tokens = set(sampled_tokens(logits, SamplingParams(temperature=3.0, top_p=1e-4)))
    assert tokens == {int(logits.argmax())}


def test_top_p_keeps_smallest_set_reaching_the_mass():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    tokens = set(sampled_tokens(logits, SamplingParams(top_p=0.7)))
    assert tokens == {0, 1}


def test_min_p_filters_relative_to_the_top_token():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]).log()
    tokens = set(sampled_tokens(logits, SamplingParams(min_p=0.4)))  # threshold 0.16
    assert tokens == {0, 1, 2}


def test_low_temperature_concentrates():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    hot = sampled_tokens(logits, SamplingParams(temperature=1.0), trials=1000)
    cold = sampled_tokens(logits, SamplingParams(temperature=0.1), trials=1000)
    assert cold.count(0) > 950
    assert 350 < hot.count(0) < 550  # softmax p0 ~= 0.45


# ---- penalties and min_new_tokens ------------------------------------------------------------


def penalized_logits(
    logits: torch.Tensor, params: SamplingParams, output: list[int], prompt: list[int] = ()
) -> torch.Tensor:
    """One row of logits [4] after penalties."""
    batch = make_batch([params], output_ids=[output], prompt_ids=[list(prompt)], vocab_size=4)
    return apply_penalties(logits[None].clone(), batch)[0]


def test_repetition_penalty_lowers_repeated_tokens_of_both_signs():
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0])
    out = penalized_logits(logits, SamplingParams(repetition_penalty=2.0), [0], prompt=[1])
    assert out.tolist() == [1.0, -2.0, 3.0, -2.0]


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    batch = make_batch([params], output_ids=[[0]], vocab_size=4)
    batch_plain = make_batch([SamplingParams(temperature=0)], output_ids=[[0]], vocab_size=4)
    assert int(sample(logits, batch)) == 1 and int(sample(logits, batch_plain)) == 0


def test_frequency_and_presence_penalties_exact():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = penalized_logits(logits, params, [2, 2, 2, 0], prompt=[1, 1])
    # token 2: 1 - 0.5*3 - 0.25 = -0.75; token 0: 1 - 0.5 - 0.25 = 0.25; prompt tokens untouched.
    assert torch.allclose(out, torch.tensor([0.25, 1.0, -0.75, 1.0]))


def test_penalties_only_touch_their_rows():
    logits = random_logits(2)
    params = [SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0)]
    top = logits.argmax(-1).tolist()
    out = sample(logits, make_batch(params, output_ids=[[top[0]] * 9, [top[1]] * 9]))
    assert int(out[0]) != top[0] and int(out[1]) == top[1]


def test_logit_bias_is_added_before_the_repetition_penalty():
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0])
    params = SamplingParams(repetition_penalty=2.0, logit_bias={"0": -4, "2": 1.5})
    out = penalized_logits(logits, params, [0, 2])  # 2 - 4 = -2 -> -4; 3 + 1.5 = 4.5 -> 2.25
    assert out.tolist() == [-4.0, -1.0, 2.25, -2.0]


def test_logit_bias_bans_and_forces_tokens_in_their_rows_only():
    logits = random_logits(3)
    top = logits.argmax(-1).tolist()
    forced = (top[2] + 1) % V
    params = [
        SamplingParams(temperature=0, logit_bias={str(top[0]): -100}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, logit_bias={str(forced): 100}),
    ]
    assert not is_plain_argmax(params[0], 0) and is_plain_argmax(params[1], 0)
    second = logits[0].topk(2).indices[1]
    for seed in range(20):
        out = sample(logits, make_batch(params, [seed] * 3)).tolist()
        assert out == [second, top[1], forced]


def test_allowed_token_ids_mask_their_rows_only():
    logits = random_logits(3)
    allowed = [3, 17, 29]
    params = [
        SamplingParams(temperature=0, allowed_token_ids=allowed),
        SamplingParams(temperature=0),
        SamplingParams(temperature=2.0, allowed_token_ids=[5]),
    ]
    assert not is_plain_argmax(params[0], 0)
    best = max(allowed, key=lambda t: logits[0, t])
    for seed in range(20):
        out = sample(logits, make_batch(params, [seed] * 3)).tolist()
        assert out == [best, int(logits[1].argmax()), 5]


def test_bad_words_ban_the_token_that_would_complete_them():
    """vLLM's rule: a word's last token is banned where the output ends with the rest."""
    assert banned_next([[5], [7, 9], [1, 2, 3]], [4, 7]) == [5, 9]
    assert banned_next([[1, 2, 3]], [1, 2]) == [3] and banned_next([[1, 2, 3]], [2]) == []
    logits = torch.zeros(2, V)
    logits[:, 9] = 5.0
    params = [SamplingParams(temperature=0, bad_words_ids=[[7, 9]])] * 2
    assert not is_plain_argmax(params[0], 0)
    out = sample(logits, make_batch(params, output_ids=[[3, 7], [7, 3]])).tolist()
    assert out[0] != 9 and out[1] == 9


def test_min_new_tokens_blocks_eos_until_reached():
    eos = 3
    logits = torch.tensor([[0.0, 0.0, 0.0, 10.0]])
    params = [SamplingParams(temperature=0, min_new_tokens=2)]
    for step, expect_eos in [(0, False), (1, False), (2, True)]:
        batch = make_batch(params, output_ids=[[0] * step], stop_ids=[[eos]], vocab_size=4)
        assert (int(sample(logits, batch)) == eos) == expect_eos


def test_min_new_tokens_blocks_in_sampled_rows_too():
    logits = torch.tensor([[0.0, 0.0, 5.0, 5.0]]).expand(200, -1)
    params = [SamplingParams(min_new_tokens=1)] * 200
    batch = make_batch(params, list(range(200)), stop_ids=[[2, 3]] * 200, vocab_size=4)
    assert set(sample(logits, batch).tolist()) <= {0, 1}


def test_sample_rejects_vocab_mismatch():
    with pytest.raises(ValueError, match="vocab"):
        sample(torch.zeros(1, V + 1), make_batch([SamplingParams()]))


def test_build_rejects_out_of_vocab_stop_ids():
    with pytest.raises(ValueError, match="min_new_tokens"):
        make_batch([SamplingParams(min_new_tokens=1)], stop_ids=[[V]])


# ---- logprobs --------------------------------------------------------------------------------


def test_token_logprobs_match_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 5.0]])
    ids = torch.tensor([2, 1])
    expected = torch.log_softmax(logits, -1)[[0, 1], [2, 1]]
    assert torch.allclose(token_logprobs(logits, ids), expected, atol=1e-6)
    by_hand = 3 - math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert math.isclose(float(token_logprobs(logits, ids)[0]), by_hand, rel_tol=1e-6)


def test_top_logprobs_sorted_descending():
    logits = random_logits(4)
    values, ids = top_logprobs(logits, 5)
    assert values.shape == ids.shape == (4, 5)
    assert torch.all(values[:, :-1] >= values[:, 1:])
    expected = torch.log_softmax(logits, -1).topk(5)
    assert torch.equal(ids, expected.indices)
    assert torch.allclose(values, expected.values, atol=1e-6)
    assert top_logprobs(logits, 0).values.shape == (4, 0)
