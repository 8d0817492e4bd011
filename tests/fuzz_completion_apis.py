"""Fuzz bodies and answer checks for the completion APIs (tests/test_http_fuzz.py): SGLang's
native /generate and OpenAI's /v1/completions and /v1/chat/completions.

Every answer must be a 2xx (a stream ending in `data: [DONE]`, no request aborted by an
internal error) or a 4xx whose JSON error's `param` names the offending field (or one the
server derived from the body: DERIVED); never a 5xx.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fuzz_common import (
    ARGUMENTS,
    JSON_TEXTS,
    JUNK,
    ODD_TEMPLATE_KWARGS,
    SMALL_TOKENS,
    TEMPLATE_KWARGS,
    as_sent,
    fuzzed,
    odd,
    openai_error_problems,
    top_fields,
)
from fuzz_common import check as check_with
from hypothesis import strategies as st

# Names a 4xx may give besides the body's own fields: the body itself, the prompt however
# it was given, required fields that are missing, and max_new_tokens at its default (128,
# with the prompt past the fuzz server's short context).
DERIVED = {"body", "prompt", "messages", "model", "text", "input_ids", "max_new_tokens"}


# ---- strategies --------------------------------------------------------------------------

ODD_TOKENS = odd(-1, 10**6, 2**63, 10**30, 2.5, "3", True, 3)
STOP = st.sampled_from(["\n", "the", ["a", "b"], [], [""]])
ODD_STOP = odd([1], 5, [["x"]], {"a": 1})
REGEX = st.sampled_from(["[ab]{1,3}", "\\d+", "(yes|no)"])
ODD_REGEX = odd("[a-", "(", "", "a{99999999}", 5)
JSON_SCHEMA = st.sampled_from(
    [{"type": "string", "maxLength": 4}, {"type": "object"}, '{"type": "integer"}']
)
ODD_JSON_SCHEMA = odd("{not json", {"type": "nonsense"}, {"type": "integer", "minimum": "x"}, [])
ODD_N = odd(0, -1, 10**4, 10**9, 10**30, 2.0, "2")
SEED = st.integers(-5, 2**40)
ODD_SEED = odd(2**63, -(2**63) - 1, 10**30, 1.5, "7")
ODD_COUNT = odd(-1, 21, 10**6, 10**30, True, "2", 1.0)
PROMPT_TEXT = st.sampled_from(["Hello", "The capital of France is", "a", "2 + 2 ="])
TOKEN_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=8)
ODD_PROMPT = odd("", "x " * 100, [], [""], [-1], [10**9], [[]], [[1], "a"], [1, [2]], {"a": 1})

LOGIT_BIAS = st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3)
SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 1, 5, 50]),
    "min_p": st.floats(0, 1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "stop": STOP,
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 2),
    "sampling_seed": SEED,
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "regex": REGEX,
    "json_schema": JSON_SCHEMA,
    "logit_bias": LOGIT_BIAS,
}
ODD_SAMPLING = {
    "max_new_tokens": ODD_TOKENS,
    "min_new_tokens": ODD_TOKENS,
    "temperature": odd(-1, "hot", math.nan),
    "top_p": odd(0, 1.5, -0.5),
    "top_k": odd(0, -2, 10**30),
    "min_p": odd(2, -1),
    "frequency_penalty": odd(3, -2.5),
    "presence_penalty": odd(3),
    "repetition_penalty": odd(0, 3),
    "stop": ODD_STOP,
    "stop_token_ids": odd([-4], [10**9], 5),
    "ignore_eos": odd(1, "yes"),
    "n": ODD_N,
    "sampling_seed": ODD_SEED,
    "regex": ODD_REGEX,
    "json_schema": ODD_JSON_SCHEMA,
    "ebnf": odd("root ::= undefined", 'root ::= "a"'),
    "stop_regex": JUNK,
    "structural_tag": odd({"structures": [], "triggers": []}, "{", {"type": "structural_tag"}),
    "logit_bias": odd({"5": -101}, {"-5": 1}, {"5": "1"}),
    "bogus": JUNK,
}
SAMPLING_PARAMS = fuzzed(
    st.fixed_dictionaries({"max_new_tokens": SMALL_TOKENS}, optional=SAMPLING),
    ODD_SAMPLING,
    raw=False,
)
GENERATE_PROMPT = st.one_of(
    st.fixed_dictionaries({"text": PROMPT_TEXT | st.lists(PROMPT_TEXT, min_size=1, max_size=2)}),
    st.fixed_dictionaries({"input_ids": TOKEN_IDS | st.lists(TOKEN_IDS, min_size=1, max_size=2)}),
)
GENERATE_OPTIONAL = {
    "return_logprob": st.booleans(),
    "top_logprobs_num": st.integers(0, 5),
    "logprob_start_len": st.integers(-1, 3),
    "return_text_in_logprobs": st.booleans(),
    "rid": st.uuids().map(str),
    "stream": st.booleans(),
    "cache_salt": st.text(max_size=4),
}
GENERATE_BODY = fuzzed(
    st.tuples(
        GENERATE_PROMPT,
        st.fixed_dictionaries({"sampling_params": SAMPLING_PARAMS}, optional=GENERATE_OPTIONAL),
    ).map(lambda parts: parts[0] | parts[1]),
    {
        "text": ODD_PROMPT,
        "input_ids": ODD_PROMPT,
        "sampling_params": odd([{}, 5], "hot"),
        "return_logprob": odd(1, "yes"),
        "top_logprobs_num": ODD_COUNT,
        "logprob_start_len": odd(-2, 10**6, 10**30, "x"),
        "rid": odd("", 5, ["a", "b"]),
        "stream": odd(1, "yes"),
        "cache_salt": odd(5, ["x"]),
        "return_text_in_logprobs": odd(2),
    },
)

RESPONSE_FORMATS = [
    {"type": "text"},
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}},
]
OPENAI_OPTIONAL = {
    "model": st.just("tiny"),
    "n": st.integers(1, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "stop": STOP,
    "presence_penalty": st.floats(-2, 2),
    "seed": SEED,
    "stream": st.booleans(),
    "response_format": st.sampled_from(RESPONSE_FORMATS),
    "cache_salt": st.text(max_size=4),
    "user": st.text(max_size=4),
    "logit_bias": LOGIT_BIAS,
}
ODD_OPENAI = {
    "model": odd("other", 5),
    "n": ODD_N,
    "temperature": odd(-1, "x"),
    "top_p": odd(0, 2),
    "stop": ODD_STOP,
    "presence_penalty": odd(9),
    "seed": ODD_SEED,
    "max_tokens": ODD_TOKENS,
    "min_tokens": ODD_TOKENS,
    "stream": odd(1, "true"),
    "stream_options": odd(
        {"include_usage": True},
        {"include_usage": 1},
        {"x": 1},
        {"include_usage": True, "continuous_usage_stats": True},
        {"continuous_usage_stats": "yes"},
    ),
    "response_format": odd(
        {"type": "json_schema"},
        {"type": "xml"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
        {"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<"]},
        {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>"}},
    ),
    "regex": ODD_REGEX | REGEX,
    "json_schema": ODD_JSON_SCHEMA | JSON_SCHEMA,
    "cache_salt": odd(5),
    "logit_bias": odd({"5": 101}, {"x": 1}, {str(10**20): 1}, {"5": None}, [5]),
    "best_of": odd(1, 2),
    "structured_outputs": odd(
        {"choice": []},
        {"json": 5},
        {"regex": "a", "grammar": "b"},
        {"choice": ["a", "b"]},
        {"whitespace_pattern": " "},
    ),  # fmt: skip
    "include_stop_str_in_output": odd(1, True),
    "allowed_token_ids": odd([], [-1], [10**9], [5]),
    "suffix": odd("x"),
}
COMPLETION_BODY = fuzzed(
    st.fixed_dictionaries(
        {
            "prompt": PROMPT_TEXT | TOKEN_IDS | st.lists(PROMPT_TEXT, min_size=1, max_size=2),
            "max_tokens": SMALL_TOKENS,
        },
        optional=OPENAI_OPTIONAL | {"logprobs": st.integers(0, 5), "echo": st.booleans()},
    ),
    ODD_OPENAI | {"prompt": ODD_PROMPT, "logprobs": ODD_COUNT, "echo": odd(1)},
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def call_with(text: str) -> dict[str, Any]:
    return TOOL_CALL | {"function": {"name": "f", "arguments": text}}


MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system"]),
            "content": st.sampled_from(["hi", "", "What is 2+2?"]),
        }
    ),
    st.just({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
    st.builds(
        lambda text: {"role": "assistant", "content": None, "tool_calls": [call_with(text)]},
        ARGUMENTS,
    ),
    st.just({"role": "tool", "content": "4", "tool_call_id": "c1"}),
)
ODD_MESSAGES = odd(
    [],
    "hi",
    [{"role": "bot", "content": "x"}],
    [{"role": "user"}],
    [{"content": "x"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"role": "user", "content": "x", "name": 5}],
    [{"role": "tool", "content": "x"}],
    [{"role": "assistant", "tool_calls": [5]}],
    [{"role": "assistant", "tool_calls": {}}],
    [{"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}],
    [None],
) | st.builds(
    lambda text: [
        {
            "role": "assistant",
            "tool_calls": [TOOL_CALL | {"function": {"name": "f", "arguments": text}}],
        }
    ],
    JSON_TEXTS,
)
CHAT_BODY = fuzzed(
    st.fixed_dictionaries(
        {"messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": SMALL_TOKENS},
        optional=OPENAI_OPTIONAL
        | {
            "logprobs": st.just(True),
            "top_logprobs": st.integers(0, 5),
            "tools": st.just([TOOL]),
            "tool_choice": st.sampled_from(["none", "auto"]),
            "chat_template_kwargs": TEMPLATE_KWARGS,
            "continue_final_message": st.booleans(),
        },
    ),
    ODD_OPENAI
    | {
        "messages": ODD_MESSAGES,
        "continue_final_message": odd(1, "yes"),
        "max_completion_tokens": ODD_TOKENS | SMALL_TOKENS,
        "logprobs": odd(1, "yes"),
        "top_logprobs": ODD_COUNT,
        "tools": odd(
            [{"type": "function"}],
            [TOOL, TOOL],
            {},
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
        ),
        "tool_choice": odd(
            "sometimes",
            "required",
            {"type": "function"},
            {"type": "function", "function": {"name": "g"}},
        ),
        "chat_template_kwargs": ODD_TEMPLATE_KWARGS,
        "parallel_tool_calls": JUNK,
    },
)


# ---- checking one answer -----------------------------------------------------------------


def problems_with(body: Any, status: int, text: str) -> list[str]:
    """What is wrong with the server's answer to `body`; empty when nothing is."""
    if status >= 500:
        return [f"{status}: {text[:300]}"]
    if status >= 400:
        return openai_error_problems(body_fields(body), status, text)
    if text.startswith("data:"):
        return _stream_problems(text)
    return _internal_aborts(json.loads(text))


def body_fields(body: Any) -> set[str]:
    """The body's fields and sampling parameters (with their OpenAI names), and the names a
    4xx may give a field it derived from the body."""
    body = as_sent(body)  # a raw body the server may still parse
    fields = top_fields(body)
    params = body.get("sampling_params") if isinstance(body, dict) else None
    for entry in params if isinstance(params, list) else [params]:
        fields |= set(entry) if isinstance(entry, dict) else set()
    openai_names = {
        "max_tokens": "max_new_tokens",
        "seed": "sampling_seed",
        "min_tokens": "min_new_tokens",
    }
    return fields | {name for name, core in openai_names.items() if core in fields} | DERIVED


def _stream_problems(text: str) -> list[str]:
    if not text.endswith("data: [DONE]\n\n"):
        return [f"stream does not end with [DONE]: ...{text[-200:]}"]
    events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    problems = []
    for event in events[:-1]:
        problems += _internal_aborts(json.loads(event))
    return problems


def _internal_aborts(reply: Any) -> list[str]:
    """Requests the server ended for its own failure (an error event, an abort with 5xx)."""
    replies = reply if isinstance(reply, list) else [reply]
    problems = []
    for item in replies:
        if not isinstance(item, dict):
            continue
        if "error" in item:
            problems.append(f"error event: {item['error']}")
        finish = item.get("meta_info", {}).get("finish_reason")
        if isinstance(finish, dict) and finish.get("status_code", 0) >= 500:
            problems.append(f"aborted by the server: {finish}")
    return problems


def check(url: str, body: Any) -> int:
    """Sends `body`; fails on any problem with the answer, else returns its status."""
    return check_with(url, body, problems_with)


# ---- /v1/score ---------------------------------------------------------------------------

SCORE_IDS = st.lists(st.integers(200, 4000), max_size=8)
SCORE_TEXT = st.text(max_size=30)
SCORE_BODY = st.tuples(
    st.fixed_dictionaries(
        {"query": SCORE_TEXT, "items": SCORE_TEXT | st.lists(SCORE_TEXT, min_size=1, max_size=3)}
    )
    | st.fixed_dictionaries(
        {"query": SCORE_IDS, "items": st.lists(SCORE_IDS, min_size=1, max_size=3)}
    ),
    st.fixed_dictionaries(
        {"label_token_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=4)},
        optional={
            "apply_softmax": st.booleans(),
            "item_first": st.booleans(),
            "model": st.just("tiny"),
            "cache_salt": st.sampled_from(["t1", "t2"]),
        },
    ),  # fmt: skip
).map(lambda parts: parts[0] | parts[1])
SCORE_ODD = {
    "query": odd(5, [-1], [[1]], None), "items": odd([], [1], [[-1]], ["a"] * 2100, 3),
    "label_token_ids": odd([], [10**9], [-1], "a", [1.5]), "apply_softmax": odd("yes", 1),
    "item_first": odd(0, "no"), "model": odd("other", 3), "cache_salt": odd(5),
}  # fmt: skip
SCORE_CASES = fuzzed(SCORE_BODY, SCORE_ODD)
SCORE_REQUIRED = {"query", "items", "label_token_ids"}


def score_problems(body: Any, status: int, text: str) -> list[str]:
    """A 200 holds one row of probabilities in [0, 1] per item, one per label token; a 4xx
    may name a required field the body lacks."""
    if 400 <= status < 500:
        return openai_error_problems(body_fields(body) | SCORE_REQUIRED, status, text)
    if status != 200:
        return problems_with(body, status, text)
    items = body["items"]
    rows = json.loads(text)["scores"]
    count = 1 if isinstance(items, str) else len(items)
    ok = len(rows) == count and all(
        len(row) == len(body["label_token_ids"]) and all(0 <= p <= 1 for p in row) for row in rows
    )
    return [] if ok else [f"scores do not fit the body: {text[:300]}"]
