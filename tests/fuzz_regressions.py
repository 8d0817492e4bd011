"""Bodies the HTTP fuzz (tests/test_http_fuzz.py) once found answered wrongly, with the
status each must get now; test_regressions sends each on every run and checks the answer as
the fuzz does (a 4xx names the offending field)."""

from __future__ import annotations

import math
from typing import Any

from fuzz_common import DEEP_ARGUMENTS, HUGE_ARGUMENTS

HI = {"role": "user", "content": "hi"}
CHAT = {"max_tokens": 1}
MESSAGES = {"model": "tiny", "max_tokens": 1, "messages": [HI]}
COUNT = {"model": "tiny", "messages": [HI]}
RESPONSES = {"model": "tiny", "max_output_tokens": 1}
TOO_LONG = {"x": -(2**63) - 1}  # a schema with an int past int64
DEEP_KWARGS = {"x": "<deep list>"}  # fuzz_common.RAW_JSON: sent as DEEP_DEPTH nested lists


def assistant_call(arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "tool_calls": [call]}


def function_call(arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}


REGRESSIONS = [
    # (path, body, status): bodies once answered wrongly, checked on every run.
    ("/generate", {"text": "a", "sampling_params": {"temperature": math.nan}}, 400),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "logit_bias": {"5": 101}}, 400),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "logit_bias": {str(10**20): 1}}, 400),
    # Ints past int64 could not cross to the engine core: a 500, and the request stayed
    # registered (its rid in use, its queue slot taken) for good. A seed may be any int.
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "top_k": 10**30}}, 400),
    ("/generate", {"text": "a", "sampling_params": {"min_new_tokens": 10**30}}, 400),
    ("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": 10**30}, 400),
    ("/generate", {"text": "a", "return_logprob": True, "logprob_start_len": 10**30}, 400),
    (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": 2, "sampling_seed": 10**30}},
        200,
    ),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "seed": 10**30, "n": 2}, 200),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "seed": -(2**64)}, 200),
    # n past what the server can ever admit was a 503 after building n specs (n = 10**9: an
    # out-of-memory server); now a 400 before any is built.
    ("/generate", {"text": "a", "sampling_params": {"n": 10**9}}, 400),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1, "n": 40}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 10**6}, 400),
    # Python's JSON parser raised past the server's handler: a 500 for a deeply nested body,
    # a 400 naming no field (and suggesting sys.set_int_max_str_digits) for a 5000-digit int.
    ("/generate", b"[" * 100_000 + b"]" * 100_000, 400),
    ("/v1/chat/completions", b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", 400),
    # 4xx whose param was the message's first word ("provide", "unknown"), not a field.
    ("/generate", {}, 400),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1, "bogus": 1}}, 400),
    ("/generate", {"text": "a", "sampling_params": {"| x": 1}}, 400),  # was "sampling"
    (
        "/v1/completions",
        {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}},
        400,
    ),  # was "include_usage", not a field of the body
    # A template of the request's own reached Jinja: range() past the sandbox's limit was a
    # 500, and a template may loop for ever.
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a"}],
            "max_tokens": 1,
            "chat_template_kwargs": {"chat_template": "{% for i in range(10**8) %}x{% endfor %}"},
        },
        400,
    ),
    (
        "/tokenize",
        {
            "prompt": None,
            "messages": [{"role": "user", "content": "a"}],
            "chat_template_kwargs": {"chat_template": "{{ messages }}"},
        },
        400,
    ),
    # Function-call arguments Python's JSON parser refuses: nested too deeply was a 500
    # (RecursionError), a 5000-digit int a 400 naming no field (its ValueError escaped).
    ("/v1/chat/completions", CHAT | {"messages": [HI, assistant_call(DEEP_ARGUMENTS)]}, 400),
    ("/v1/chat/completions", CHAT | {"messages": [HI, assistant_call(HUGE_ARGUMENTS)]}, 400),
    ("/v1/responses", RESPONSES | {"input": [function_call(DEEP_ARGUMENTS)]}, 400),
    ("/v1/responses", RESPONSES | {"input": [function_call(HUGE_ARGUMENTS)]}, 400),
    # chat_template_kwargs nested deeper than rendering can walk: a 500 on every chat API.
    ("/v1/chat/completions", CHAT | {"messages": [HI], "chat_template_kwargs": DEEP_KWARGS}, 400),
    ("/v1/messages", MESSAGES | {"chat_template_kwargs": DEEP_KWARGS}, 400),
    ("/v1/messages/count_tokens", COUNT | {"chat_template_kwargs": DEEP_KWARGS}, 400),
    ("/v1/responses", RESPONSES | {"input": "hi", "chat_template_kwargs": DEEP_KWARGS}, 400),
    # An unknown field's name was not quoted: the empty name left the message naming nothing.
    ("/v1/messages", MESSAGES | {"": 1}, 400),
    # Anthropic's error names no param: its message must start with the field ("body: ...").
    ("/v1/messages/count_tokens", [1], 400),
    # A json_schema object with an int past int64 (an unknown keyword's value) crossed to the
    # engine core as an object, which its wire format could not encode: a 500.
    (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": 1, "json_schema": TOO_LONG}},
        200,
    ),
    ("/v1/chat/completions", CHAT | {"messages": [HI], "json_schema": TOO_LONG}, 200),
    # SGLang's sessions and newer sampling params: malformed input is a 400 naming it.
    ("/open_session", {"timeout": -1}, 400),
    ("/open_session", {"session_id": 5}, 400),
    ("/open_session", [1], 400),
    ("/close_session", {"session_id": None}, 400),
    ("/generate", {"text": "a", "session_params": []}, 400),
    ("/generate", {"text": "a", "session_params": {"id": "x" * 300}}, 400),
    ("/generate", {"text": "a", "sampling_params": {"stop_regex": "(" * 2000}}, 400),
    ("/generate", {"text": "a", "return_logprob": True, "token_ids_logprob": [[1, 2]]}, 200),
    # Responses' include: a list of unhashable values was a 500.
    ("/v1/responses", RESPONSES | {"input": "hi", "include": [[], {"a": 1}]}, 400),
    # Conversations: malformed bodies are a 400 naming the field.
    ("/v1/conversations", {"items": "hi"}, 400),
    ("/v1/conversations", {"metadata": 5}, 400),
    ("/v1/conversations", {"items": [{"type": "message", "role": "user", "content": 5}]}, 400),
    ("/v1/conversations", {"bogus": 1}, 400),
    # More items than the server runs and queues: the builder's "n" (not in the body) was
    # the param; it is the items
    ("/v1/score", {"query": "a", "items": ["b"] * 100, "label_token_ids": [1]}, 400),
]
