"""The Engine's logprobs on a tiny random model (SmolLM2's tokenizer, vocab 49152): their
layout, SGLang's token_ids_logprob, a one-token prompt."""

from __future__ import annotations

import pytest

from conftest import VOCAB, greedy, make_engine, prompt_ids


def test_logprobs_layout(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    prompt = prompt_ids(11, 40)
    out = engine.generate(
        input_ids=prompt,
        sampling_params=greedy(5),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inputs) == 40 and inputs[0][0] is None
    assert [e[1] for e in inputs] == prompt and all(e[0] <= 0 for e in inputs[1:])
    assert [e[1] for e in outputs] == out["output_ids"]
    assert all(isinstance(e[2], str) for e in outputs)
    top = meta["output_top_logprobs"]
    assert len(top) == 5 and all(len(t) == 3 for t in top)
    assert all(t[0][1] == e[1] for t, e in zip(top, outputs))  # greedy: the top token
    again = engine.generate(
        input_ids=prompt, sampling_params=greedy(5), return_logprob=True, logprob_start_len=0
    )
    first = [e[0] for e in inputs[1:]]
    second = [e[0] for e in again["meta_info"]["input_token_logprobs"][1:]]
    assert second == pytest.approx(first, abs=1e-4)  # the cache never serves scored positions


def test_token_ids_logprob_reports_the_asked_ids_at_every_position(tiny_chat_model):
    """SGLang's token_ids_logprob: per position, the logprobs of the given ids, in order;
    the same values the chosen and top entries report."""
    engine = make_engine(tiny_chat_model)
    prompt = prompt_ids(16, 30)
    args = dict(input_ids=prompt, sampling_params=greedy(4), return_logprob=True)
    plain = engine.generate(**args, logprob_start_len=0, top_logprobs_num=2)["meta_info"]
    asked = [prompt[5], plain["output_top_logprobs"][0][1][1]]
    meta = engine.generate(**args, logprob_start_len=0, token_ids_logprob=asked)["meta_info"]
    inputs, outputs = meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"]
    assert len(inputs) == 30 and inputs[0] is None and len(outputs) == 4
    assert all([e[1] for e in row] == asked for row in inputs[1:] + outputs)
    assert inputs[5][0][0] == pytest.approx(plain["input_token_logprobs"][5][0], abs=1e-4)
    assert outputs[0][1][0] == pytest.approx(plain["output_top_logprobs"][0][1][0], abs=1e-4)
    out = engine.generate(**args, token_ids_logprob=[asked])["meta_info"]  # one list per prompt
    flat = [e[0] for row in out["output_token_ids_logprobs"] for e in row]
    assert flat == pytest.approx([e[0] for row in outputs for e in row], abs=1e-4)
    assert "output_token_ids_logprobs" not in engine.generate(**args)["meta_info"]
    for bad in ([VOCAB], [[1], [2]], "1", list(range(129))):
        with pytest.raises(ValueError, match="^token_ids_logprob"):
            engine.generate(**args, token_ids_logprob=bad)


def test_one_token_prompt_has_its_null_input_logprob(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    out = engine.generate(
        input_ids=[5], sampling_params=greedy(2), return_logprob=True, logprob_start_len=0
    )
    assert out["meta_info"]["input_token_logprobs"] == [[None, 5, None]]
