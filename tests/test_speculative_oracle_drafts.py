"""Speculative decoding (NGRAM) with drafts from an oracle on the random `tiny_chat_model`,
whose greedy output rarely repeats: drafts right for a varying prefix, or always wrong,
exercise every acceptance length in mixed batches, under retraction, within a grammar and in
`bench simulate`; the tokens are those of plain decoding and the pool stays balanced."""

from __future__ import annotations

import pytest
from speculative_common import NGRAM, ids_of, spec_stats

from conftest import VOCAB, greedy, make_engine, prompt_ids
from radixserve.config import SchedulerConfig
from radixserve.engine.request import Req
from radixserve.engine.speculative import Drafter
from radixserve.sampling.params import SamplingParams


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


def _mixed_prompts() -> list[list[int]]:
    """Different lengths, so prefill chunks share steps with verifying decodes."""
    return [prompt_ids(i, 20 + 23 * i) for i in range(5)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_partly_right_drafts_in_mixed_batches_give_identical_tokens(tiny_chat_model, page_size):
    prompts = _mixed_prompts()
    kwargs = dict(page_size=page_size, chunked_prefill_size=32)
    plain = make_engine(tiny_chat_model, **kwargs)
    expected = ids_of(plain.generate(input_ids=prompts, sampling_params=greedy(30)))
    spec = make_engine(tiny_chat_model, **kwargs, **NGRAM)
    initial_free = spec.runner.pool.allocator.num_free
    spec.scheduler.drafter = OracleDrafter({tuple(p): e for p, e in zip(prompts, expected)})
    outputs = spec.generate(input_ids=prompts, sampling_params=greedy(30))
    assert ids_of(outputs) == expected
    stats = spec_stats(spec)
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
    expected = ids_of(
        make_engine(tiny_chat_model).generate(input_ids=prompts, sampling_params=greedy(20))
    )
    spec = make_engine(tiny_chat_model, page_size=1, **NGRAM)
    initial_free = spec.runner.pool.allocator.num_free
    spec.scheduler.drafter = WrongDrafter()
    assert ids_of(spec.generate(input_ids=prompts, sampling_params=greedy(20))) == expected
    stats = spec_stats(spec)
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] == 0
    spec.check_integrity()
    assert spec.flush_cache() and spec.runner.pool.allocator.num_free == initial_free


def test_tiny_pool_retracts_verifying_requests_and_still_matches(tiny_chat_model):
    prompts = [prompt_ids(i, 24) for i in range(10)]
    expected = ids_of(
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
    assert ids_of(small.generate(input_ids=prompts, sampling_params=greedy(60))) == expected
    assert small.get_stats()["retractions"] > 0 and oracle.proposed > 0
    small.check_integrity()
    assert small.flush_cache() and small.runner.pool.allocator.num_free == initial_free


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
    assert ids_of(outputs) == ids_of(expected)
    stats = spec_stats(spec)
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
