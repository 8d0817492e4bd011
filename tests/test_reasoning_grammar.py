"""Grammar after reasoning (sampling/reasoning_grammar.py): free until the reasoning's end
text, constrained after it; a reasoning budget forces the end text."""

from __future__ import annotations

import json

import pytest

from conftest import greedy, prompt_ids

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}  # fmt: skip


def test_budget_ends_the_reasoning_then_the_schema_holds(engine):
    params = greedy(64, ignore_eos=False, temperature=1.0, sampling_seed=3, json_schema=SCHEMA,
                    reasoning_end="</think>", max_reasoning_tokens=6)  # fmt: skip
    [out] = engine.generate(input_ids=[prompt_ids(0)], sampling_params=params)
    reasoning, end, content = out["text"].partition("</think>")
    assert end and reasoning.strip(), out["text"]
    assert isinstance(json.loads(content)["n"], int)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    engine.check_integrity()


def test_budget_alone_needs_no_grammar(engine):
    params = greedy(12, reasoning_end="</think>", max_reasoning_tokens=3)
    [out] = engine.generate(input_ids=[prompt_ids(1)], sampling_params=params)
    assert "</think>" in out["text"]


def test_matcher_is_free_before_the_end_and_rolls_back_across_it(engine):
    import xgrammar as xgr

    backend = engine.scheduler.grammar
    compiled = backend.compile_async("regex", "[0-9]{3}").result()
    from radixserve.sampling.params import SamplingParams

    matcher = backend.matcher(compiled, SamplingParams(regex="[0-9]{3}", reasoning_end="</think>"))
    tokenizer = engine.tokenizer
    mask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    thought = tokenizer.encode("hm ok</think>", add_special_tokens=False)
    for token in thought[:-1]:
        matcher.fill_next_token_bitmask(mask, 0)
        assert bool((mask == -1).all())  # free while reasoning
        assert matcher.accept_token(token) and not matcher.ended
    assert matcher.accept_token(thought[-1]) and matcher.ended
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    digit = tokenizer.encode("7", add_special_tokens=False)[0]
    assert not matcher.accept_token(letter)
    assert matcher.accept_token(digit)
    matcher.rollback(2)  # the digit and the token that ended the reasoning
    assert not matcher.ended and matcher.accept_token(letter)


def test_bad_reasoning_params_name_the_field(engine):
    for params, field in [({"max_reasoning_tokens": 3}, "max_reasoning_tokens"),
                          ({"reasoning_end": ""}, "reasoning_end"),
                          ({"reasoning_end": "</think>", "max_reasoning_tokens": -1},
                           "max_reasoning_tokens")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            engine.generate(input_ids=prompt_ids(0), sampling_params=params)
