"""Jump-forward for constrained output: text the grammar forces is appended unsampled.

Outputs need not equal plain constrained decoding (the forced text may be tokenized
differently), but must stay valid, exact about max_new_tokens and stop strings, report
logprobs of every output token, and leave the pool balanced.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from conftest import greedy, make_engine, prompt_ids

KEYS = ["customer_id", "order_total", "item_count", "priority_level", "warehouse_code"]
ORDER = {
    "type": "object",
    "properties": {
        **{key: {"type": "integer", "minimum": 0, "maximum": 999} for key in KEYS},
        "express": {"type": "boolean"},
        "status": {"enum": ["open", "shipped", "closed"]},
    },
    "required": [*KEYS, "express", "status"],
    "additionalProperties": False,
}
LITERAL = r"The order was (accepted|rejected) by the warehouse after review number [0-9]{2}\."
LITERAL_EBNF = (
    'root ::= "The order was " verdict " by the warehouse after review number " [0-9] [0-9] "."\n'
    'verdict ::= "accepted" | "rejected"'
)


def _run(engine, params: dict, prompts=None, **extra):
    prompts = prompts or [prompt_ids(i, 24) for i in range(3)]
    outputs = engine.generate(input_ids=prompts, sampling_params=params, **extra)
    return outputs, engine.get_stats()


@pytest.mark.parametrize("page_size", [1, 16])
def test_schema_with_fixed_keys_jumps_and_stays_valid(tiny_chat_model, page_size):
    params = greedy(120, json_schema=ORDER, ignore_eos=False)
    on_engine = make_engine(tiny_chat_model, page_size=page_size)
    on, on_stats = _run(on_engine, params)
    off_engine = make_engine(tiny_chat_model, page_size=page_size, disable_jump_forward=True)
    off, off_stats = _run(off_engine, params)
    for out in on + off:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), ORDER)
    assert all(o["meta_info"]["jump_forward_tokens"] > 0 for o in on)
    assert all(o["meta_info"]["jump_forward_tokens"] == 0 for o in off)
    assert on_stats["jump_forward_tokens"] > 0 and off_stats["jump_forward_tokens"] == 0
    assert on_stats["forward_steps"] < off_stats["forward_steps"] / 2
    on_engine.check_integrity()
    off_engine.check_integrity()


@pytest.mark.parametrize("kind", ["regex", "ebnf"])
def test_a_long_literal_and_the_requests_around_it(tiny_chat_model, kind):
    """A long fixed literal is jumped over, from the first token on; an unconstrained
    request in the same batch gets exactly the tokens it gets alone."""
    engine = make_engine(tiny_chat_model)
    plain = engine.generate(input_ids=prompt_ids(9), sampling_params=greedy(20))
    constraint = {kind: LITERAL if kind == "regex" else LITERAL_EBNF}
    outputs = engine.generate(
        input_ids=[prompt_ids(9), prompt_ids(1), prompt_ids(2)],
        sampling_params=[greedy(20), greedy(60, **constraint), greedy(60, **constraint)],
    )
    assert outputs[0]["output_ids"] == plain["output_ids"]
    assert "jump_forward_tokens" not in outputs[0]["meta_info"]
    for out in outputs[1:]:
        assert re.fullmatch(LITERAL, out["text"]), out["text"]
        # of ~25 tokens, only the choice, the digits and the end are sampled
        assert out["meta_info"]["jump_forward_tokens"] >= len(out["output_ids"]) - 6
    engine.check_integrity()


def test_max_new_tokens_counts_forced_tokens(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    lengths = [1, 2, 3, 5, 8, 13]
    outputs = engine.generate(
        input_ids=[prompt_ids(i) for i in range(len(lengths))],
        sampling_params=[greedy(n, regex=LITERAL) for n in lengths],
    )
    for n, out in zip(lengths, outputs):
        assert len(out["output_ids"]) == n, out
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert "The order was "[: len(out["text"])] == out["text"][:14], out["text"]
    assert outputs[-1]["meta_info"]["jump_forward_tokens"] > 0
    engine.check_integrity()


def test_a_stop_string_inside_forced_text_ends_the_request(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    out = engine.generate(
        input_ids=prompt_ids(4), sampling_params=greedy(60, regex=LITERAL, stop=["warehouse"])
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "warehouse"}
    assert re.fullmatch(r"The order was (accepted|rejected) by the ", out["text"]), out["text"]
    engine.check_integrity()


def test_forced_tokens_report_the_models_logprobs(tiny_chat_model):
    """Each output token's logprob, forced or sampled, is the one the model gives it in
    context: the same as scoring the finished sequence as a prompt."""
    engine = make_engine(tiny_chat_model)
    prompt = prompt_ids(6)
    args = dict(return_logprob=True, top_logprobs_num=2)
    out = engine.generate(
        input_ids=prompt, sampling_params=greedy(80, json_schema=ORDER, ignore_eos=False), **args
    )
    meta = out["meta_info"]
    assert meta["jump_forward_tokens"] > 0
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(meta["output_top_logprobs"]) == len(out["output_ids"])
    scored = engine.generate(
        input_ids=prompt + out["output_ids"],
        sampling_params=greedy(1),
        logprob_start_len=len(prompt) - 1,
        **args,
    )
    want = [v for v, _, _ in scored["meta_info"]["input_token_logprobs"][1:]]
    got = [v for v, _, _ in meta["output_token_logprobs"]]
    assert np.allclose(got, want, atol=1e-4)


def test_forced_tokens_found_in_the_cache_are_still_scored(tiny_chat_model):
    """A forced opening is prefilled with the prompt; a second identical request finds
    prompt + opening in the cache, yet must compute the rows that score the opening."""
    engine = make_engine(tiny_chat_model, page_size=1)
    args = dict(input_ids=prompt_ids(8), return_logprob=True)
    params = greedy(30, regex=LITERAL)
    first, again = (engine.generate(sampling_params=params, **args) for _ in range(2))
    assert again["meta_info"]["cached_tokens"] > 0
    values = []
    for out in (first, again):
        values.append([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert len(values[-1]) == len(out["output_ids"]) and None not in values[-1]
    assert again["output_ids"] == first["output_ids"]
    assert np.allclose(values[0], values[1], atol=1e-4)
    engine.check_integrity()


def test_logprobs_stay_aligned_when_forced_tokens_end_the_request(tiny_chat_model):
    """Forced tokens that reach max_new_tokens are never computed: their logprob is None.
    Streamed chunks carry output tokens only with their logprobs (forced ones wait)."""
    engine = make_engine(tiny_chat_model)
    args = dict(input_ids=prompt_ids(7), return_logprob=True, top_logprobs_num=1)
    try:
        cut = engine.generate(sampling_params=greedy(7, regex=LITERAL), **args)["meta_info"]
        params = greedy(40, regex=LITERAL)
        whole = engine.generate(sampling_params=params, **args)
        chunks = [c for c in engine.generate(sampling_params=params, stream=True, **args)]
    finally:
        engine.shutdown()
    values = [v for v, _, _ in cut["output_token_logprobs"]]
    assert len(values) == cut["completion_tokens"] == 7 and values[-1] is None
    assert all(v is not None for v in values[: values.index(None)])
    assert len(chunks) > 2 and chunks[-1]["output_ids"] == whole["output_ids"]
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert whole["text"].startswith(chunk["text"])
    streamed = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert streamed == whole["meta_info"]["output_token_logprobs"]


def test_retraction_speculation_and_samples_keep_pages_balanced(tiny_chat_model):
    engine = make_engine(
        tiny_chat_model,
        max_total_tokens=512,
        chunked_prefill_size=64,
        schedule_conservativeness=0.1,
        speculative_algorithm="NGRAM",
    )
    params = {"json_schema": ORDER, "temperature": 1.0, "max_new_tokens": 100, "n": 2}
    outputs = engine.generate(input_ids=[prompt_ids(i, 24) for i in range(8)],
                              sampling_params=params)  # fmt: skip
    assert len(outputs) == 16
    for out in outputs:
        jsonschema.validate(json.loads(out["text"]), ORDER)
    stats = engine.get_stats()
    assert stats["retractions"] > 0 and stats["jump_forward_tokens"] > 0
    engine.check_integrity()


def test_speculation_on_top_changes_no_greedy_token(tiny_chat_model):
    """NGRAM drafts are checked against the grammar and a request does not speculate while
    it extends forced tokens: greedy output is the same with and without speculation."""
    prompts = [prompt_ids(i, 24) for i in range(4)]
    params = greedy(120, json_schema=ORDER, ignore_eos=False)
    want, _ = _run(make_engine(tiny_chat_model), params, prompts)
    spec = make_engine(tiny_chat_model, speculative_algorithm="NGRAM")
    for _ in range(2):  # the second round drafts from the store the first one filled
        got, stats = _run(spec, params, prompts)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert stats["spec_accepted_tokens"] > 0 and stats["jump_forward_tokens"] > 0
    spec.check_integrity()


def test_find_jump_retokenizes_the_newest_token_and_leaves_the_matcher(tiny_chat_model):
    from radixserve.sampling.jump_forward import find_jump

    engine = make_engine(tiny_chat_model)
    backend, tokenizer = engine.scheduler.grammar, engine.tokenizer
    compiled = backend.compile_async("regex", r'\{"name": "[a-z]+"\}').result()
    matcher = backend.matcher(compiled)
    newest = tokenizer.encode('{"', add_special_tokens=False)
    assert len(newest) == 1 and matcher.accept_token(newest[0])
    jump = find_jump(matcher, tokenizer, newest, can_replace=True, room=50)
    assert jump.num_replaced == 1
    # ` "` could still grow into a longer token (` "Jo`): the jump stops before it
    assert jump.tokens == tokenizer.encode('{"name":', add_special_tokens=False)
    assert matcher.find_jump_forward_string() == 'name": "'  # where it was
    # not the newest token's to change: appended after it, cut to the room left
    kept = find_jump(matcher, tokenizer, newest, can_replace=False, room=2)
    assert kept.num_replaced == 0 and len(kept.tokens) == 2
    assert '{"name":'.startswith(tokenizer.decode(newest + kept.tokens))


def test_the_flag_is_generated_and_the_count_crosses_the_core_pipe():
    from radixserve.cli import build_parser
    from radixserve.engine.protocol import RequestOutput, StepOutputs
    from radixserve.engine.wire import decode_from_core, encode

    args = build_parser().parse_args(["serve", "--disable-jump-forward"])
    assert args.disable_jump_forward is True
    assert build_parser().parse_args(["serve"]).disable_jump_forward is False
    sent = StepOutputs([RequestOutput("a", [1, 2], jump_forward_tokens=5)])
    assert decode_from_core(encode(sent)) == sent


@pytest.mark.slow
def test_default_model_json_with_fixed_keys_validates_and_jumps():
    from radixserve import Engine

    with Engine(max_total_tokens=8192) as engine:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Give me an order record as JSON."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        params = {"json_schema": ORDER, "temperature": 0, "max_new_tokens": 160}
        out = engine.generate(prompt, params)
        jsonschema.validate(json.loads(out["text"]), ORDER)
        assert out["meta_info"]["jump_forward_tokens"] > len(out["output_ids"]) / 2
        engine.check_integrity()
