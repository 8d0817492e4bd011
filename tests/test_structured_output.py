"""Constrained decoding (xgrammar): JSON schema, regex, EBNF; errors, retraction, cache."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conftest import greedy, make_engine, prompt_ids

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def smollm():
    from radixserve import Engine

    with Engine(max_total_tokens=16384) as engine:
        yield engine


@pytest.mark.slow
def test_json_schema_outputs_validate(smollm):
    prompt = smollm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give me a user record as JSON."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    params = {"json_schema": PERSON, "temperature": 1.0, "max_new_tokens": 320, "n": 20}
    params["sampling_seed"] = 1234  # reproducible; any seed must validate
    outputs = smollm.generate(prompt, params)
    assert len(outputs) == 20
    for out in outputs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), PERSON)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [DATE, PHONE])
def test_regex_outputs_fullmatch(smollm, pattern):
    params = {"regex": pattern, "temperature": 1.0, "max_new_tokens": 32, "n": 8}
    for out in smollm.generate("Write it down: ", params):
        assert re.fullmatch(pattern, out["text"]), out["text"]


@pytest.mark.slow
def test_ebnf_grammar(smollm):
    grammar = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z]{1,12}'
    params = {"ebnf": grammar, "temperature": 1.0, "max_new_tokens": 32, "n": 6}
    for out in smollm.generate("Is the sky blue? Answer:", params):
        assert re.fullmatch(r"(yes|no) because [a-z]{1,12}", out["text"]), out["text"]


def test_bad_constraints_are_value_errors_naming_the_field(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    for params, field in [
        ({"regex": "(unclosed"}, "regex"),
        ({"json_schema": "{nope"}, "json_schema"),
        ({"ebnf": "root ::= missing"}, "ebnf"),
        ({"regex": "a", "json_schema": {}}, "json_schema"),
        ({"structural_tag": "{nope"}, "structural_tag"),
        ({"structural_tag": {"structures": [], "triggers": []}}, "structural_tag"),
        (
            {"structural_tag": {"type": "structural_tag", "format": {"type": "bogus"}}},
            "structural_tag",
        ),
        ({"ebnf": 'root ::= "a"', "structural_tag": {"x": 1}}, "structural_tag"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine.generate(input_ids=prompt_ids(0), sampling_params=params)
    assert not engine.scheduler.has_work()


def test_constrained_requests_survive_retraction_and_hit_the_compile_cache(tiny_chat_model):
    pattern = r"[a-z]{200,240}\."
    # a low conservativeness admits on a small output estimate, so that decodes must retract
    engine = make_engine(tiny_chat_model, max_total_tokens=384, chunked_prefill_size=64,
                         schedule_conservativeness=0.1)  # fmt: skip
    params = greedy(300) | {"regex": pattern, "ignore_eos": False, "temperature": 1.0}
    outputs = engine.generate(input_ids=[prompt_ids(i, 24) for i in range(16)],
                              sampling_params=params)  # fmt: skip
    stats = engine.get_stats()
    assert stats["retractions"] > 0
    assert all(re.fullmatch(pattern, o["text"]) for o in outputs), [o["text"] for o in outputs]
    assert stats["grammar_compiles"] == 1 and stats["grammar_cache_hits"] == 15
    engine.check_integrity()


def test_json_strings_refuse_raw_control_characters(tiny_chat_model):
    """JSON forbids unescaped control characters in strings; xgrammar lets them into
    length-bounded ones unless we tighten its grammar (grammar.json_schema_ebnf)."""
    engine = make_engine(tiny_chat_model)
    backend = engine.scheduler.grammar
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string",
                                                                   "maxLength": 12}}})  # fmt: skip
    matcher = backend.matcher(backend.compile_async("json_schema", schema).result())
    assert matcher.accept_string('{"city": "ab')
    assert not matcher.accept_string("\x08")
    assert matcher.accept_string('cd"}')


def test_sglang_structural_tags_leave_text_free_until_a_trigger(tiny_chat_model):
    """SGLang's form ({"structures": [{"begin", "schema", "end"}], "triggers"}): free text,
    and after a trigger one of the structures, its JSON checked against its schema."""
    add = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
           "additionalProperties": False}  # fmt: skip
    structure = {"begin": "<function=add>", "schema": add, "end": "</function>"}
    tag = json.dumps({"structures": [structure], "triggers": ["<function="]})
    backend = make_engine(tiny_chat_model).scheduler.grammar
    compiled = backend.compile_async("structural_tag", tag).result()
    matcher = backend.matcher(compiled)
    assert matcher.accept_string("Let me add them. <function=add>")
    assert not matcher.accept_string('{"b": 2}')
    assert matcher.accept_string('{"a": 2}</function> Done; any text again.')
    assert not backend.matcher(compiled).accept_string("Now <function=mul>")
