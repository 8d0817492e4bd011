"""Speculative decoding (NGRAM): drafts verified in the running batch change nothing but speed.

Two tiny models: the random `tiny_chat_model`, whose greedy output rarely repeats (drafts from
an oracle that is right for a varying prefix, or always wrong, exercise every acceptance
length), and a `periodic_model` whose greedy output cycles through 7 tokens, so the n-gram
drafter's own drafts are mostly accepted.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import TINY, VOCAB, greedy, make_engine, prompt_ids
from radixserve.config import SchedulerConfig
from radixserve.engine.request import Req
from radixserve.engine.speculative import Drafter, Verifier
from radixserve.engine.speculative.ngram import (
    NgramStore,
    match_suffix,
    suffix_hashes,
    window_hashes,
)
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import SamplingBatch, scale_and_filter

CYCLE = [1000 + 37 * i for i in range(7)]
NGRAM = {"speculative_algorithm": "NGRAM"}


@pytest.fixture(scope="module")
def periodic_model(tmp_path_factory) -> str:
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
    folder = tmp_path_factory.mktemp("periodic")
    model.save_pretrained(folder)
    return str(folder)


class OracleDrafter(Drafter):
    """Knows each prompt's reference output: drafts it right for a prefix whose length
    varies with the step (0..K), then wrong, so every acceptance length occurs."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], num_draft_tokens: int = 4):
        self.references = references
        self.num_draft_tokens = num_draft_tokens
        self.proposed = 0

    def propose(self, req: Req) -> list[int]:
        done = len(req.output_ids)
        right = self.references[tuple(req.input_ids)][done : done + self.num_draft_tokens]
        num_right = (done * 7 + len(req.input_ids)) % (self.num_draft_tokens + 1)
        self.proposed += 1
        return right[:num_right] + [(t + 1) % VOCAB for t in right[num_right:]]


class WrongDrafter(Drafter):
    num_draft_tokens = 3

    def propose(self, req: Req) -> list[int]:
        return [(req.seq_ids()[-1] + 1 + i) % VOCAB for i in range(self.num_draft_tokens)]


def _ids(outputs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def _spec_stats(engine) -> dict:
    return {k: v for k, v in engine.get_stats().items() if k.startswith("spec_")}


def _mixed_prompts() -> list[list[int]]:
    """Different lengths, so prefill chunks share steps with verifying decodes."""
    return [prompt_ids(i, 20 + 23 * i) for i in range(5)]


# ---- end to end: identical greedy tokens --------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_ngram_greedy_matches_plain_decoding_cold_and_warm(periodic_model, page_size):
    prompts = [prompt_ids(i, 40) for i in range(4)]
    plain = make_engine(periodic_model, page_size=page_size)
    spec = make_engine(periodic_model, page_size=page_size, **NGRAM)
    initial_free = spec.runner.pool.allocator.num_free
    expected = _ids(plain.generate(input_ids=prompts, sampling_params=greedy(45)))
    cold = spec.generate(input_ids=prompts, sampling_params=greedy(45))
    warm = spec.generate(input_ids=prompts, sampling_params=greedy(45))
    assert _ids(cold) == _ids(warm) == expected
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in warm)
    stats = _spec_stats(spec)
    assert stats["spec_accepted_tokens"] > 0.8 * stats["spec_draft_tokens"] > 0
    assert stats["spec_accept_length"] > 2.5
    assert stats["spec_verify_steps"] < spec.get_stats()["decode_tokens"] / 2
    spec.check_integrity()
    assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free


@pytest.mark.parametrize("page_size", [1, 16])
def test_partly_right_drafts_in_mixed_batches_give_identical_tokens(tiny_chat_model, page_size):
    prompts = _mixed_prompts()
    kwargs = dict(page_size=page_size, chunked_prefill_size=32)
    plain = make_engine(tiny_chat_model, **kwargs)
    expected = _ids(plain.generate(input_ids=prompts, sampling_params=greedy(30)))
    spec = make_engine(tiny_chat_model, **kwargs, **NGRAM)
    initial_free = spec.runner.pool.allocator.num_free
    spec.scheduler.drafter = OracleDrafter({tuple(p): e for p, e in zip(prompts, expected)})
    outputs = spec.generate(input_ids=prompts, sampling_params=greedy(30))
    assert _ids(outputs) == expected
    stats = _spec_stats(spec)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    for o in outputs:
        meta = o["meta_info"]
        assert meta["spec_verify_ct"] > 0 and meta["spec_draft_token_num"] > 0
        assert meta["spec_accept_length"] == pytest.approx(30 / meta["spec_verify_ct"])
        rate = meta["spec_accept_token_num"] / meta["spec_draft_token_num"]
        assert meta["spec_accept_rate"] == pytest.approx(rate)
    spec.check_integrity()
    assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free


def test_rejected_drafts_leave_the_pool_balanced(tiny_chat_model):
    prompts = _mixed_prompts()
    expected = _ids(
        make_engine(tiny_chat_model).generate(input_ids=prompts, sampling_params=greedy(20))
    )
    spec = make_engine(tiny_chat_model, page_size=1, **NGRAM)
    initial_free = spec.runner.pool.allocator.num_free
    spec.scheduler.drafter = WrongDrafter()
    assert _ids(spec.generate(input_ids=prompts, sampling_params=greedy(20))) == expected
    stats = _spec_stats(spec)
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] == 0
    spec.check_integrity()
    assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free


def test_tiny_pool_retracts_verifying_requests_and_still_matches(tiny_chat_model):
    prompts = [prompt_ids(i, 24) for i in range(10)]
    expected = _ids(
        make_engine(tiny_chat_model).generate(input_ids=prompts, sampling_params=greedy(60))
    )
    # a bold admission estimate: speculation needs fewer steps, so the estimate decays slower
    small = make_engine(
        tiny_chat_model,
        max_total_tokens=384,
        chunked_prefill_size=64,
        schedule_conservativeness=0.1,
        **NGRAM,
    )
    initial_free = small.runner.pool.allocator.num_free
    oracle = OracleDrafter({tuple(p): e for p, e in zip(prompts, expected)})
    small.scheduler.drafter = oracle
    assert _ids(small.generate(input_ids=prompts, sampling_params=greedy(60))) == expected
    assert small.get_stats()["retractions"] > 0 and oracle.proposed > 0
    small.check_integrity()
    assert small.flush_cache() and small.runner.pool.allocator.num_free == initial_free


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
    assert len(expected["output_ids"]) > 20 and _spec_stats(spec)["spec_accepted_tokens"] > 0
    spec.check_integrity()


def test_logprobs_and_penalties_match_plain_decoding(periodic_model):
    prompt = prompt_ids(5, 40)
    params = greedy(30, frequency_penalty=0.3, repetition_penalty=1.1)
    args = dict(input_ids=prompt, return_logprob=True, top_logprobs_num=2)
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
    assert got["spec_draft_token_num"] > 0


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
    assert _spec_stats(spec)["spec_verify_steps"] == 0
    with pytest.raises(ValueError, match="speculative"):
        spec.generate(input_ids=prompt_ids(2), sampling_params=greedy(3, speculative="no"))
    plain = make_engine(periodic_model)
    assert (
        "spec_verify_ct"
        not in plain.generate(input_ids=prompt_ids(2), sampling_params=greedy(3))["meta_info"]
    )


def test_http_generate_reports_spec_meta_info_and_metrics(periodic_model):
    """The native /generate handler and /metrics over an in-process engine (a server
    subprocess would cost ~20 s to start here); the core pipe's codec is checked below."""
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from radixserve.server.app import build_app

    engine = make_engine(periodic_model, speculative_num_draft_tokens=3, **NGRAM)
    state = _server_state(engine, periodic_model)
    body = {"input_ids": prompt_ids(4, 40), "sampling_params": greedy(30)}

    async def run():
        async with TestClient(TestServer(build_app(state))) as client:
            generated = await (await client.post("/generate", json=body)).json()
            bad = body | {"sampling_params": {"speculative": 1}}
            rejected = await client.post("/generate", json=bad)
            metrics = await (await client.get("/metrics")).text()
            return generated, (rejected.status, await rejected.text()), metrics

    out, (status, error), text = asyncio.run(run())
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 30 and meta["spec_accept_token_num"] > 0
    assert meta["spec_accept_length"] == pytest.approx(30 / meta["spec_verify_ct"])
    assert meta["spec_draft_token_num"] <= 3 * meta["spec_verify_ct"]
    assert sum(meta["spec_drafter_verify_ct"].values()) == meta["spec_verify_ct"]
    assert meta["spec_drafter_verify_ct"]["NGRAM"] > 0  # the steps NGRAM drafted
    assert status == 400 and "speculative" in error
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["radixserve:spec_accepted_tokens_total"] == meta["spec_accept_token_num"]
    assert values["radixserve:spec_verify_steps_total"] == meta["spec_verify_ct"]
    assert values["radixserve:spec_draft_tokens_total"] == meta["spec_draft_token_num"]
    assert values["radixserve:spec_accept_length"] > 1


def test_openai_endpoints_take_the_opt_out_and_stay_free_of_spec_counts(periodic_model):
    """`speculative` is an extra body field of both OpenAI endpoints (false: no verify step
    counted); the counts stay native-only, as in SGLang and vLLM (usage has none)."""
    from aiohttp.test_utils import TestClient, TestServer

    from radixserve.server.app import build_app

    engine = make_engine(periodic_model, **NGRAM)
    state = _server_state(engine, periodic_model)
    completion = {"prompt": prompt_ids(4, 40), "max_tokens": 20, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}

    async def post(client, path, body):
        before = engine.get_stats()["spec_verify_steps"]
        response = await client.post(path, json=body)
        counted = engine.get_stats()["spec_verify_steps"] - before
        return response.status, await response.json(), counted

    async def run():
        async with TestClient(TestServer(build_app(state))) as client:
            results = {}
            for name, path, body in [
                ("completion", "/v1/completions", completion),
                ("chat", "/v1/chat/completions", chat),
            ]:
                results[name, True] = await post(client, path, body)
                results[name, False] = await post(client, path, body | {"speculative": False})
                results[name, "bad"] = await post(client, path, body | {"speculative": "no"})
            return results

    results = asyncio.run(run())
    for name in ("completion", "chat"):
        (status_on, on, steps_on), (status_off, off, steps_off) = (
            results[name, True],
            results[name, False],
        )
        assert status_on == status_off == 200
        assert steps_on > 0 and steps_off == 0  # verify steps: the speculating request's only
        assert (
            on["choices"][0]["text" if name == "completion" else "message"]
            == off["choices"][0]["text" if name == "completion" else "message"]
        )
        assert not any("spec" in key for key in on["usage"])
        status, error, _ = results[name, "bad"]
        assert status == 400 and "speculative" in error["error"]["message"]


def test_spec_counts_cross_the_core_pipe():
    from radixserve.engine.protocol import RequestOutput, SpecCounts, StepOutputs
    from radixserve.engine.wire import decode_from_core, encode

    counts = SpecCounts(3, 8, 5, {"SUFFIX": 2, "none": 1}, {"SUFFIX": 5, "none": 0})
    sent = StepOutputs([RequestOutput("a", [1, 2], spec_counts=counts)])
    assert decode_from_core(encode(sent)) == sent


# ---- the acceptance rule's distribution -----------------------------------------------------


def _chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the draws against `probs` over its support, and its dof."""
    support = torch.nonzero(probs > 0).flatten().tolist()
    counts = np.bincount(tokens, minlength=probs.numel())
    assert counts[[i for i in range(probs.numel()) if i not in support]].sum() == 0
    expected = np.array([probs[i].item() for i in support]) * len(tokens)
    return float(((counts[support] - expected) ** 2 / expected).sum()), len(support) - 1


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}
"""Chi-square quantiles at p = 0.999 by degrees of freedom."""
TARGET_ROWS = (  # a verify row and the bonus row after it, vocab 10
    [3.0, 2.5, 2.0, 1.6, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0],
    [0.3, -1.2, 2.2, 0.1, 1.4, -0.4, 1.9, 0.7, -2.0, 1.1],
)


def _verify_many(draft: int, num: int = 6000):
    """`num` requests (seeds 0..num-1) verify the one-token draft `draft` at temperature 1,
    top_p 0.9; returns their outcomes and the target distributions p of both rows."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)
    reqs = [Req(f"r{i}", [1, 2, 3], params, seed=i) for i in range(num)]
    rows = torch.tensor(TARGET_ROWS)
    results = Verifier(lambda req: []).verify(reqs, [[draft]] * num, rows.repeat(num, 1))
    batch = SamplingBatch.build([params] * 2, [0, 0], [[], [draft]], [[1, 2, 3]] * 2, [[], []], 10)
    return results, scale_and_filter(rows, batch, slice(None)).softmax(dim=-1)


@pytest.mark.parametrize("draft", [0, 3])  # the target's most likely token, an unlikely one
def test_tokens_emitted_through_verification_follow_the_target_distribution(draft):
    """Position 0 through a one-token draft, position 1 (the bonus token) after an accept:
    both follow p after temperature and top-p, whatever the draft."""
    results, target = _verify_many(draft)
    first = [r.tokens[0] for r in results]
    stat, dof = _chi_square(first, target[0])
    assert stat < CHI2_999[dof], (stat, dof)
    bonus = [r.tokens[1] for r in results if r.num_accepted == 1]
    assert len(bonus) == first.count(draft) > 300
    stat, dof = _chi_square(bonus, target[1])
    assert stat < CHI2_999[dof], (stat, dof)


@pytest.mark.parametrize("bias", ["always_accept", "no_removal"])
def test_a_biased_acceptance_rule_fails_the_distribution_check(monkeypatch, bias):
    """The check above has the power to catch a wrong rule: accepting every draft, or
    drawing the replacement from p without removing the rejected draft."""
    from radixserve.engine.speculative import verifier

    def biased(logits, batch, rows, drafts):
        accepted, replaced = original(logits, batch, rows, drafts)
        if bias == "always_accept":
            return accepted | (drafts >= 0), replaced
        draws = verifier.scale_and_filter(logits, batch, rows) + verifier.gumbel_from_uniform(
            verifier.uniform_noise(batch.seeds[rows], batch.steps[rows], batch.vocab_size)
        )
        return accepted, draws.argmax(dim=-1)

    original = verifier._accept_sampled
    monkeypatch.setattr(verifier, "_accept_sampled", biased)
    results, target = _verify_many(draft=1)
    stat, dof = _chi_square([r.tokens[0] for r in results], target[0])
    assert stat > CHI2_999[dof]


# ---- n-gram drafting --------------------------------------------------------------------------


def test_match_suffix_prefers_the_longest_then_the_latest_match():
    seq = np.array([5, 1, 2, 9, 7, 1, 2, 3, 4, 8, 2, 3, 1, 2, 3])
    assert match_suffix(seq, 1, 4, 2) == [4, 8]  # [1, 2, 3] at 5..7 beats [2, 3] at 10..11
    assert match_suffix(seq, 1, 2, 3) == [1, 2, 3]  # windows <= 2: the latest [2, 3]
    assert match_suffix(seq, 4, 6, 2) == []
    assert match_suffix(np.array([7, 7, 7]), 1, 3, 4) == [7]


def test_store_hashes_agree_between_indexing_and_lookup():
    seq = [7, 3, 9, 3, 1]
    keys = suffix_hashes(seq, salt=12345)
    for n, hashes in window_hashes(np.array(seq), len(seq), salt=12345):
        assert keys[n - 1] == int(hashes[-1])


def test_ngram_store_is_bounded_lru_and_per_namespace():
    store = NgramStore(capacity=60, min_window=1, max_window=3, num=2)
    seqs = [[base + i for i in range(6)] for base in range(100, 700, 100)]  # 12 n-grams each
    for seq in seqs[:5]:
        store.add(None, seq)
    assert store.lookup(None, [9, 101, 102]) == [103, 104]  # the first is now the newest used
    assert store.lookup("other", [9, 101, 102]) == []
    store.add(None, seqs[5])  # past the capacity: the least recently used sequences go
    assert len(store) <= 60
    assert store.lookup(None, [101]) == [102, 103] and store.lookup(None, [603]) == [604, 605]
    assert store.lookup(None, [201]) == [] and store.lookup(None, [501]) == []
    store.add(None, list(range(1000, 1100)))  # longer than the capacity allows: its end only
    assert len(store) <= 60 and store.lookup(None, [1097]) == [1098, 1099]


def test_bad_speculative_flags_fail_naming_the_flag(tiny_chat_model):
    cases = {
        "speculative_num_draft_tokens": dict(speculative_num_draft_tokens=0),
        "speculative_ngram_max_match_window_size": dict(
            speculative_ngram_min_match_window_size=4, speculative_ngram_max_match_window_size=2
        ),
        "speculative_algorithm must be NGRAM, SELF, STANDALONE": dict(
            speculative_algorithm="MEDUSA"
        ),
        "STANDALONE needs --speculative-draft-model-path": dict(speculative_algorithm="STANDALONE"),
        "speculative_draft_model_path needs --speculative-algorithm STANDALONE": dict(
            speculative_algorithm="SELF", speculative_draft_model_path="x"
        ),
        "speculative_num_steps needs": dict(speculative_num_steps=2),
        "speculative_num_steps must be between 1 and": dict(
            speculative_algorithm="SELF", speculative_num_steps=5
        ),
        "speculative_self_layers must be >= 1": dict(speculative_self_layers=0),
        "speculative_adaptive_threshold must be >= 0": dict(speculative_adaptive_threshold=-1),
        "speculative_disable_by_batch_size must be >= 1": dict(speculative_disable_by_batch_size=0),
    }
    for message, flags in cases.items():
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**(NGRAM | flags)).verify()
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        make_engine(tiny_chat_model, speculative_num_draft_tokens=-1, **NGRAM)


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


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


def test_constrained_requests_speculate_within_the_grammar(tiny_chat_model):
    """Drafts are cut where the grammar forbids them, verify rows are masked by the grammar
    advanced over the drafts before them, and the grammar advances over kept tokens only."""
    prompts = [prompt_ids(i, 30) for i in range(4)]
    params = [greedy(40, regex="[a-z]+( [a-z]+){6,10}")] * 2 + [greedy(40, json_schema=SCHEMA)] * 2
    expected = make_engine(tiny_chat_model).generate(input_ids=prompts, sampling_params=params)
    spec = make_engine(tiny_chat_model, **NGRAM)
    oracle = OracleDrafter({tuple(p): e["output_ids"] for p, e in zip(prompts, expected)})
    spec.scheduler.drafter = oracle
    outputs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["text"] for o in outputs] == [e["text"] for e in expected]
    assert _ids(outputs) == _ids(expected)
    stats = _spec_stats(spec)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    spec.check_integrity()


def test_the_simulator_answers_verify_rows():
    """`bench simulate` drives the real scheduler: with speculation on, its stand-in model
    answers the verify rows too, and accepted drafts save virtual time."""
    from radixserve.config import CacheConfig
    from radixserve_bench.sim_runner import CostModel, SimRunner
    from radixserve_bench.simulate import sim_scheduler

    def run(algorithm, drafter=None):
        runner = SimRunner(CacheConfig(page_size=4, max_total_tokens=1024), CostModel())
        sched = sim_scheduler(runner, SchedulerConfig(speculative_algorithm=algorithm))
        sched.drafter = drafter or sched.drafter
        reqs = [Req(f"r{i}", prompt_ids(i, 20), SamplingParams(**greedy(24)), 0) for i in range(3)]
        for req in reqs:
            sched.add_request(req)
        while sched.has_work():
            sched.step()
        sched.cache.check_integrity(sched.held_pages())
        return [r.output_ids for r in reqs], runner.clock, sched.stats

    expected, plain_clock, _ = run(None)
    assert run("NGRAM")[0] == expected
    oracle = OracleDrafter({tuple(prompt_ids(i, 20)): out for i, out in enumerate(expected)})
    outputs, clock, stats = run("NGRAM", oracle)
    assert outputs == expected and stats.spec_accepted_tokens > 0 and clock < plain_clock


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


def _server_state(engine, model_path: str):
    """The HTTP app's state over an in-process engine (no server process)."""
    from radixserve.config import ServerConfig
    from radixserve.server.metrics import ServerMetrics
    from radixserve.server.state import ServerState

    return ServerState(
        client=engine.client,
        builder=engine.builder,
        tokenizer=engine.tokenizer,
        config=ServerConfig(),
        engine_args={},
        model_path=model_path,
        served_model_name="periodic",
        max_running_requests=256,
        metrics=ServerMetrics(),
    )
