"""The Engine end to end on a tiny random model (SmolLM2's tokenizer, vocab 49152)."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import Future

import pytest

from conftest import SYSTEM, VOCAB, greedy, make_core, make_engine, prompt_ids
from radixserve import Engine
from radixserve.engine import admission as admission_module
from radixserve.engine.request import Req, ReqState
from radixserve.engine.scheduler import Scheduler
from radixserve.sampling.params import SamplingParams


def test_generate_shapes_and_meta_info(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    single = engine.generate(input_ids=prompt_ids(0), sampling_params=greedy(8))
    assert len(single["output_ids"]) == 8
    meta = single["meta_info"]
    assert meta["prompt_tokens"] == 30 and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    batch = engine.generate(input_ids=[prompt_ids(1), prompt_ids(2)], sampling_params=greedy(4))
    assert isinstance(batch, list) and [len(o["output_ids"]) for o in batch] == [4, 4]
    assert engine.generate(prompt=["hello", "world"], sampling_params=greedy(2))[1]["text"]
    engine.check_integrity()


def test_cold_warm_and_disabled_cache_give_identical_tokens(tiny_chat_model):
    prompts = [SYSTEM + prompt_ids(i, 20) for i in range(4)]
    radix = make_engine(tiny_chat_model)
    cold = radix.generate(input_ids=prompts, sampling_params=greedy(12))
    warm = radix.generate(input_ids=prompts, sampling_params=greedy(12))
    plain = make_engine(tiny_chat_model, disable_radix_cache=True)
    uncached = plain.generate(input_ids=prompts, sampling_params=greedy(12))
    for c, w, u in zip(cold, warm, uncached):
        assert c["output_ids"] == w["output_ids"] == u["output_ids"]
        assert w["meta_info"]["cached_tokens"] == (len(prompts[0]) - 1) // 16 * 16
        assert u["meta_info"]["cached_tokens"] == 0
    assert plain.get_stats()["cached_tokens"] == 0


def test_shared_system_prompt_is_computed_once(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    prompts = [SYSTEM + prompt_ids(i, 10) for i in range(24)]
    outputs = engine.generate(input_ids=prompts, sampling_params=greedy(4))
    stats = engine.get_stats()
    shared = len(SYSTEM) // 16 * 16
    assert stats["prefill_tokens_computed"] <= sum(map(len, prompts)) - 23 * shared
    assert sum(o["meta_info"]["cached_tokens"] for o in outputs) >= 23 * shared
    engine.check_integrity()


def test_tiny_pool_retracts_and_still_matches_a_large_pool(tiny_chat_model):
    prompts = [prompt_ids(i, 24) for i in range(16)]
    params = greedy(100)
    big = make_engine(tiny_chat_model).generate(input_ids=prompts, sampling_params=params)
    small = make_engine(tiny_chat_model, max_total_tokens=640, chunked_prefill_size=64)
    initial_free = small.runner.pool.allocator.num_free
    out = small.generate(input_ids=prompts, sampling_params=params)
    stats = small.get_stats()
    assert stats["retractions"] > 0 and stats["evicted_pages"] > 0
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in big]
    small.check_integrity()
    assert small.flush_cache()
    assert small.runner.pool.allocator.num_free == initial_free


def test_a_request_retracted_in_a_step_is_not_readmitted_in_it(tiny_chat_model, monkeypatch):
    """The victim must wait for the next step: readmitting it at once would undo the retraction.
    Today the admission estimate usually refuses it anyway, so the test also checks that it is
    never offered to the policy in its retraction step."""
    engine = make_core(tiny_chat_model, max_total_tokens=640, chunked_prefill_size=64)
    sched = engine.scheduler
    retractions: dict[Req, int] = {}
    offered: list[str] = []
    original = admission_module.order_waiting

    def order_waiting(waiting, *args, **kwargs):
        offered.extend(r.rid for r in waiting if r.num_retractions > retractions[r])
        return original(waiting, *args, **kwargs)

    monkeypatch.setattr(admission_module, "order_waiting", order_waiting)
    reqs = [
        Req(f"r{i}", prompt_ids(i, 24), SamplingParams(**greedy(100)), seed=0) for i in range(16)
    ]
    for req in reqs:
        sched.add_request(req)
    while sched.has_work():
        retractions = {r: r.num_retractions for r in reqs}
        sched.step()
        retracted = [r for r in reqs if r.num_retractions > retractions[r]]
        assert all(r.state is ReqState.WAITING for r in retracted)
    assert sched.stats.retractions > 0 and offered == []
    engine.check_integrity()


def test_a_starved_request_waits_for_a_leader_computing_its_prefix(tiny_chat_model):
    engine = make_core(tiny_chat_model)
    sched = engine.scheduler
    shared = SYSTEM[:96]
    reqs = [Req(f"r{i}", shared + prompt_ids(i, 8), SamplingParams(**greedy(2)), 0) for i in (1, 2)]
    for req in reqs:
        req.num_bypassed = sched.config.schedule_max_bypass  # both starved
        sched.add_request(req)
    while sched.has_work():
        sched.step()
    assert engine.get_stats()["prefill_tokens_computed"] == 2 * 104 - len(shared)
    assert reqs[1].cached_tokens == len(shared)
    engine.check_integrity()


def _admit_together(sched, reqs: list[Req], first_chunk: int) -> None:
    """Puts every request in the running batch with pages for its first chunk, as an admission
    that misjudged the pool would. (The admission estimate reserves every admitted prompt's
    pages, so today this is a state to recover from rather than one the scheduler reaches.)"""
    for req in reqs:
        match = sched.cache.match_prefix(req.input_ids)
        sched.cache.lock(match.node)
        sched.pages.attach(req, match)
        assert sched.pages.grow(req, first_chunk)
        req.state = ReqState.RUNNING
        sched.running.append(req)


def test_prefills_alone_holding_the_pool_retract_one_and_all_finish(tiny_chat_model):
    """Four 120-token prompts in a 20-page pool, all prefilling, each holding 5 pages: none
    can grow and there is no decode to retract; one is retracted so that the others progress."""
    prompts = [prompt_ids(20 + i, 120) for i in range(4)]
    alone = make_engine(tiny_chat_model)
    expected = [
        alone.generate(input_ids=p, sampling_params=greedy(8))["output_ids"] for p in prompts
    ]
    engine = make_core(tiny_chat_model, max_total_tokens=320, chunked_prefill_size=32)
    sched = engine.scheduler
    initial_free = engine.runner.pool.allocator.num_free
    reqs = [Req(f"r{i}", p, SamplingParams(**greedy(8)), seed=0) for i, p in enumerate(prompts)]
    _admit_together(sched, reqs, first_chunk=80)
    assert engine.runner.pool.allocator.num_free == 0
    for _ in range(500):
        if not sched.has_work():
            break
        sched.step()
    assert all(r.finished for r in reqs)
    assert [r.output_ids for r in reqs] == expected
    assert [r.num_retractions for r in reqs] == [0, 0, 0, 1]  # equal own pages: the youngest
    engine.check_integrity()
    assert engine.flush_cache() and engine.runner.pool.allocator.num_free == initial_free


class _PendingGrammar:
    """Stands in for the grammar backend: its one compile finishes when the test says so."""

    def __init__(self):
        self.future: Future = Future()

    def compile_async(self, kind: str, spec: str) -> Future:
        return self.future


def test_step_reports_no_progress_while_only_a_grammar_compiles(tiny_chat_model, monkeypatch):
    engine = make_core(tiny_chat_model)
    sched = engine.scheduler
    grammar = _PendingGrammar()
    monkeypatch.setattr(Scheduler, "grammar", property(lambda self: grammar))
    constrained = Req("g", prompt_ids(1), SamplingParams(regex="[ab]+", **greedy(4)), seed=0)
    sched.add_request(constrained)
    for _ in range(2):
        assert sched.step() == [] and not sched.last_step_progressed
    assert sched.has_work() and sched.pending_compiles() == [grammar.future]
    grammar.future.set_exception(ValueError("no such grammar"))
    assert sched.step() == [constrained] and sched.last_step_progressed  # aborted: a change
    sched.add_request(Req("p", prompt_ids(2), SamplingParams(**greedy(2)), seed=0))
    sched.step()
    assert sched.last_step_progressed  # ran a forward
    while sched.has_work():
        sched.step()
    assert sched.step() == [] and not sched.last_step_progressed  # idle


def test_multi_turn_hits_previous_answer(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    turn1 = SYSTEM[:50] + prompt_ids(3, 27)
    answer = engine.generate(input_ids=turn1, sampling_params=greedy(40))["output_ids"]
    turn2 = turn1 + answer + prompt_ids(4, 12)
    meta = engine.generate(input_ids=turn2, sampling_params=greedy(4))["meta_info"]
    assert meta["cached_tokens"] >= (len(turn1) + len(answer) - 1) // 16 * 16


def test_sampling_seed_is_independent_of_batch_company(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 12, "sampling_seed": 7}
    alone = engine.generate(input_ids=prompt_ids(5), sampling_params=params)
    others = [{"temperature": 1.0, "max_new_tokens": 20}] * 3
    batch = engine.generate(
        input_ids=[prompt_ids(6), prompt_ids(7), prompt_ids(5), prompt_ids(8)],
        sampling_params=others[:2] + [params] + others[2:],
    )
    assert batch[2]["output_ids"] == alone["output_ids"]
    unseeded = engine.generate(
        input_ids=[prompt_ids(5)] * 2, sampling_params={"temperature": 1.0, "max_new_tokens": 12}
    )
    assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]


def test_stop_strings_are_trimmed(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    full = engine.generate(input_ids=prompt_ids(9), sampling_params=greedy(24))
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = engine.generate(input_ids=prompt_ids(9), sampling_params=greedy(24, stop=stop))
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.find(stop)]
    kept = engine.generate(
        input_ids=prompt_ids(9), sampling_params=greedy(24, stop=[stop], no_stop_trim=True)
    )
    assert kept["text"].endswith(stop) or stop in kept["text"]


def test_n_gives_n_outputs(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    outs = engine.generate(
        input_ids=prompt_ids(10), sampling_params={"n": 3, "max_new_tokens": 6, "sampling_seed": 1}
    )
    assert len(outs) == 3 and len({tuple(o["output_ids"]) for o in outs}) > 1


def test_max_new_tokens_zero_prefills_into_the_cache(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    prompt = SYSTEM[:64] + [5, 6]
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    again = engine.generate(input_ids=prompt + [7, 8], sampling_params=greedy(1))
    assert again["meta_info"]["cached_tokens"] == 64


def test_chunked_prefill_matches_one_chunk(tiny_chat_model):
    prompts = [prompt_ids(12, 150), prompt_ids(13, 70)]
    whole = make_engine(tiny_chat_model).generate(input_ids=prompts, sampling_params=greedy(8))
    chunked = make_engine(tiny_chat_model, chunked_prefill_size=32)
    out = chunked.generate(input_ids=prompts, sampling_params=greedy(8))
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in whole]
    assert chunked.get_stats()["forward_steps"] > 8


def test_async_stream_yields_cumulative_outputs(tiny_chat_model):
    engine = make_engine(tiny_chat_model)

    async def collect():
        stream = await engine.async_generate(
            input_ids=prompt_ids(14), sampling_params=greedy(6), stream=True
        )
        return [chunk async for chunk in stream]

    chunks = asyncio.run(collect())
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    final = engine.generate(input_ids=prompt_ids(14), sampling_params=greedy(6))
    assert chunks[-1]["output_ids"] == final["output_ids"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"input_ids": [1] * 3000}, "context length"),
        ({"input_ids": [1] * 30, "sampling_params": {"max_new_tokens": 2019}}, "at most 2018"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [VOCAB]}, "input_ids"),
        ({"prompt": "a", "input_ids": [1]}, "^prompt or input_ids: give exactly one"),
        ({"prompt": 5}, "^prompt must be a string"),  # said `text`, the request field's name
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokenz": 3}}, "max_new_tokenz"),
        ({"input_ids": [1], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_chat_model, kwargs, match):
    engine = make_engine(tiny_chat_model)
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)
    assert not engine.scheduler.has_work()
    engine.check_integrity()


def test_unknown_engine_argument_is_named(tiny_chat_model):
    with pytest.raises(TypeError, match="max_totl_tokens"):
        Engine(tiny_chat_model, max_totl_tokens=10)


def test_stream_never_shows_text_that_is_later_trimmed(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    full = engine.generate(input_ids=prompt_ids(15), sampling_params=greedy(24))
    ids, decode = full["output_ids"], engine.tokenizer.decode
    # a stop string that starts inside one token and ends inside the next
    k = next(k for k in range(8, 20) if len(decode(ids[k - 1 : k])) >= 2
             and len(decode(ids[k : k + 1])) >= 2)  # fmt: skip
    boundary = len(decode(ids[:k]))
    stop = full["text"][boundary - 2 : boundary + 2]
    params = greedy(24, stop=stop)
    chunks = list(engine.generate(input_ids=prompt_ids(15), sampling_params=params, stream=True))
    final = chunks[-1]["text"]
    assert final == full["text"][: full["text"].find(stop)]
    assert all(final.startswith(c["text"]) for c in chunks)  # no chunk shows the stop's start


def test_stop_regex_ends_at_a_match_and_keeps_it(tiny_chat_model):
    """SGLang's stop_regex: searched in the output's tail, the match left in the text; a
    search that runs past its time bound aborts the request instead of stalling the engine."""
    engine = make_engine(tiny_chat_model)
    full = engine.generate(input_ids=prompt_ids(17), sampling_params=greedy(24))
    piece = engine.tokenizer.decode(full["output_ids"][8:10])
    pattern = re.escape(piece.strip()) + r"\S*"
    out = engine.generate(input_ids=prompt_ids(17), sampling_params=greedy(24, stop_regex=pattern))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert (
        8 < len(out["output_ids"]) <= 10
        and out["output_ids"] == full["output_ids"][: len(out["output_ids"])]
    )
    assert re.search(pattern, out["text"]) and full["text"].startswith(out["text"])
    a_token = engine.tokenizer.encode("a")[-1]  # an output of "aaaa...": a pattern that backtracks
    params = greedy(80, stop_regex=["zzz", r"(.*a){40}b"], logit_bias={str(a_token): 100})
    slow = engine.generate(input_ids=prompt_ids(18), sampling_params=params)["meta_info"]
    assert (
        slow["finish_reason"]["type"] == "abort"
        and "stop_regex" in slow["finish_reason"]["message"]
    )
    for bad in ("(unclosed", ["a"] * 17, "x" * 1025, [5]):
        with pytest.raises(ValueError, match="^stop_regex"):
            engine.generate(input_ids=[1], sampling_params={"stop_regex": bad})
    engine.check_integrity()


def test_stream_interval_sends_tokens_in_groups(tiny_chat_model):
    """SGLang's --stream-interval (and per request sampling_params.stream_interval): the
    first token at once, then every N tokens, and the end."""
    engine = make_engine(tiny_chat_model, stream_interval=3)
    prompt = prompt_ids(19)

    def lengths(**params) -> list[int]:
        chunks = engine.generate(
            input_ids=prompt, sampling_params=greedy(10, **params), stream=True
        )
        return [len(c["output_ids"]) for c in chunks]

    grouped = lengths()
    assert grouped[0] == 1 and grouped[-1] == 10 and set(grouped) <= {1, 4, 7, 10}
    assert set(lengths(stream_interval=4)) <= {1, 5, 9, 10}
    assert len(lengths(stream_interval=1)) > len(grouped)
    with pytest.raises(ValueError, match="stream_interval"):
        engine.generate(input_ids=prompt, sampling_params={"stream_interval": 0})
    with pytest.raises(ValueError, match="stream_interval"):
        make_engine(tiny_chat_model, stream_interval=0)


def test_context_length_beyond_max_position_embeddings_gets_rope_positions(tiny_chat_model):
    """The RoPE table is reserved for the configured context up front (never grown from
    positions read on the host), so a prompt past max_position_embeddings (2048) still runs."""
    engine = make_engine(tiny_chat_model, context_length=2300)
    out = engine.generate(input_ids=prompt_ids(3, 2200), sampling_params=greedy(4))
    assert out["meta_info"]["prompt_tokens"] == 2200 and len(out["output_ids"]) == 4
    engine.shutdown()
