"""SamplingParams: SGLang's defaults, parsing from a request's dict (None means default,
unknown and unsupported keys refused by name), and validation naming the invalid parameter."""

from __future__ import annotations

import dataclasses

import pytest

from radixserve.engine.protocol import AddRequests, RequestSpec
from radixserve.engine.wire import decode_to_core, encode
from radixserve.sampling import SamplingParams

V = 32


SGLANG_DEFAULTS = dict(
    max_new_tokens=128,
    min_new_tokens=0,
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    min_p=0.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    repetition_penalty=1.0,
    stop=None,
    stop_token_ids=None,
    ignore_eos=False,
    n=1,
    sampling_seed=None,
    skip_special_tokens=True,
    spaces_between_special_tokens=True,
    no_stop_trim=False,
    regex=None,
    json_schema=None,
    ebnf=None,
    logit_bias=None,
    structural_tag=None,
    stop_regex=None,
    stream_interval=None,
)


# Ours, not SGLang's: a request may opt out of speculation; a reasoning parser defers the
# constraint to the end of the reasoning and may bound the reasoning; vLLM's allowed token
# ids and bad words.
EXTENSIONS = {
    "speculative": True,
    "reasoning_end": None,
    "max_reasoning_tokens": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "bad_words_ids": None,
}


def test_defaults_match_sglang():
    p = SamplingParams()
    assert {name: getattr(p, name) for name in SGLANG_DEFAULTS} == SGLANG_DEFAULTS
    assert {name: getattr(p, name) for name in EXTENSIONS} == EXTENSIONS
    assert set(dataclasses.asdict(p)) == set(SGLANG_DEFAULTS) | set(EXTENSIONS)
    p.verify(vocab_size=V)


def test_from_dict_none_means_default():
    p = SamplingParams.from_dict(
        {"temperature": None, "top_k": None, "stop": None, "max_new_tokens": 0, "regex": None}
    )
    assert p == SamplingParams(max_new_tokens=0)
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_from_dict_accepts_what_the_sglang_frontend_sends():
    p = SamplingParams.from_dict(
        {
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "max_new_tokens": 16,
            "min_new_tokens": 0,
            "n": 1,
            "stop": [],
            "stop_token_ids": [],
            "stop_regex": [],
            "temperature": 0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "ignore_eos": False,
            "regex": None,
            "json_schema": None,
        }
    )
    p.verify(vocab_size=V)
    assert p.is_greedy and p.stop_strs == []


def test_from_dict_rejects_unknown_key_by_name():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


@pytest.mark.parametrize("key", ["custom_params"])
def test_from_dict_rejects_unsupported_parameters(key):
    with pytest.raises(ValueError, match=f"{key}.*not supported"):
        SamplingParams.from_dict({key: "a+"})


INVALID = [
    ("max_new_tokens", -1),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", "10"),
    ("max_new_tokens", True),
    ("min_new_tokens", -1),
    ("min_new_tokens", 200),  # > max_new_tokens
    ("temperature", "hot"),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -3),
    ("presence_penalty", 2.1),
    ("presence_penalty", [1]),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.5),
    ("stop", 5),
    ("stop", ["ok", 3]),
    ("stop_token_ids", [1, V]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", [1.0]),
    ("n", 0),
    ("sampling_seed", "7"),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", 1),
    ("no_stop_trim", "no"),
    ("regex", ""),
    ("regex", 5),
    ("ebnf", ["root ::= x"]),
    ("json_schema", 3),
    ("structural_tag", ["<a>"]),
    ("stop_regex", "(unclosed"),
    ("stop_regex", ["a", 5]),
    ("stream_interval", 0),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [V]),
    ("allowed_token_ids", "1"),
    ("bad_words", "word"),
    ("bad_words", [" "]),
    ("bad_words_ids", [[]]),
    ("bad_words_ids", [[V]]),
    ("stream_interval", 1.5),
    ("logit_bias", [1]),
    ("logit_bias", {"x": 1}),
    ("logit_bias", {" 1": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {str(V): 1}),
    ("logit_bias", {"1": 101}),
    ("logit_bias", {"1": float("nan")}),
    ("logit_bias", {"1": True}),
    ("logit_bias", {"1": 10**30}),
]


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_verify_names_the_invalid_parameter(name, value):
    params = SamplingParams.from_dict({name: value})
    with pytest.raises(ValueError, match=name):
        params.verify(vocab_size=V)


def test_verify_accepts_boundaries():
    SamplingParams(
        max_new_tokens=0,
        temperature=0,
        top_p=1,
        top_k=1 << 30,
        min_p=1,
        frequency_penalty=-2,
        presence_penalty=2,
        repetition_penalty=2,
        stop="x",
        stop_token_ids=[0, V - 1],
        sampling_seed=2**70,
        logit_bias={"0": -100, V - 1: 100, "07": 0.5},
    ).verify(vocab_size=V)


def test_an_int_for_a_float_parameter_is_parsed_as_that_float():
    """An int temperature past 64 bits passed verify, then failed the core's wire: a 500."""
    params = SamplingParams.from_dict({"temperature": 2**70, "top_p": 1})
    assert params.temperature == float(2**70) and isinstance(params.top_p, float)
    params.verify(vocab_size=V)
    spec = RequestSpec(request_id="r", rid="r", input_ids=[1], params=params, seed=0)
    assert decode_to_core(encode(AddRequests([spec]))).specs[0].params == params
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_dict({"temperature": 10**400})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=10**400).verify(vocab_size=V)


def test_stop_strs_normalizes():
    assert SamplingParams(stop="\n").stop_strs == ["\n"]
    assert SamplingParams(stop=["a", "", "b"]).stop_strs == ["a", "b"]
    assert SamplingParams().stop_strs == []


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=5e-7).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
