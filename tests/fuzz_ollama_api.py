"""Fuzz bodies and answer checks for Ollama's API (tests/test_http_fuzz.py): /api/chat and
/api/generate.

Every answer must be a 2xx (a stream of NDJSON objects whose last one is done, with no error
line) or a 4xx in Ollama's shape, `{"error": message}`, whose message starts with the
offending field (quoted, or as a path: options.temperature, messages[0].role).
"""

from __future__ import annotations

import json
from typing import Any

from fuzz_agent_apis import starts_with_a_field
from fuzz_common import DEEP, SMALL_TOKENS, fuzzed, odd, top_fields
from hypothesis import strategies as st

OLLAMA_PATH = st.sampled_from(["/api/chat", "/api/generate"])
O_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
O_CALL = {"function": {"name": "f", "arguments": {"a": 1}}}
O_MESSAGE = st.sampled_from(
    [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "", "tool_calls": [O_CALL]},
        {"role": "assistant", "content": "ok", "thinking": "hm"},
        {"role": "tool", "content": "4", "tool_name": "f"},
    ]
)
OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "num_predict": SMALL_TOKENS | st.just(-1),
        "temperature": st.sampled_from([0, 0.7]),
        "top_k": st.sampled_from([1, 40]),
        "top_p": st.sampled_from([0.5, 1.0]),
        "seed": st.integers(0, 9),
        "stop": st.sampled_from([["\n"], ["a", "b"]]),
        "repeat_penalty": st.sampled_from([1.0, 1.2]),
        "num_ctx": st.just(2048),
        "mirostat": st.just(0),
    },
)
ODD_OPTIONS = odd(
    {"num_predict": -3},
    {"num_predict": 10**6},
    {"temperature": "hot"},
    {"temperature": -1},
    {"top_k": 1.5},
    {"mirostat": 2},
    {"tfs_z": 0.5},
    {"stop": [""]},
    {"repeat_penalty": 1.2, "repeat_last_n": 32},
    {"bogus": 1},
    {"seed": 2**70},
)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
COMMON = {
    "model": st.sampled_from(["tiny", "tiny:latest"]),
    "stream": st.booleans(),
    "options": OPTIONS,
}
COMMON_OPTIONAL = {
    "format": st.sampled_from(["", "json", SCHEMA]),
    "think": st.booleans(),
    "keep_alive": st.sampled_from(["5m", 0]),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 3),
}
CHAT_BODY = st.fixed_dictionaries(
    COMMON | {"messages": st.lists(O_MESSAGE, max_size=3)},
    optional=COMMON_OPTIONAL | {"tools": st.just([O_TOOL])},
)
GENERATE_BODY = st.fixed_dictionaries(
    COMMON | {"prompt": st.sampled_from(["", "hi", "The sky is"])},
    optional=COMMON_OPTIONAL
    | {
        "system": st.just("Be brief."),
        "raw": st.booleans(),
        "context": st.sampled_from([[1, 2, 3], []]),
    },
)
ODD_FIELDS = {
    "model": odd("", "llama3", 5),
    "stream": odd("yes", 1),
    "options": ODD_OPTIONS,
    "format": odd("yaml", {"type": "nonsense"}, "<deep object>", 3),
    "think": odd("max", 1),
    "logprobs": odd("yes"),
    "top_logprobs": odd(-1, 21, True),
    "messages": odd(
        "hi",
        [{"role": "nobody", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": "x", "images": ["aGk="]}],
        [{"role": "user", "content": "x", "bogus": 1}],
        [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
        [{"role": "assistant", "tool_calls": "f"}],
        [{"role": "tool", "content": "4", "tool_name": 5}],
    ),
    "tools": odd([{"type": "function"}], "f", [O_TOOL, O_TOOL]),
    "prompt": odd(5, ["hi"]),
    "system": odd(5),
    "raw": odd("yes"),
    "context": odd([-1], [10**9], "1 2", [1.5]),
    "template": odd("{{ .Prompt }}"),
    "suffix": odd("end"),
}
OLLAMA_BODY = st.one_of(fuzzed(CHAT_BODY, ODD_FIELDS), fuzzed(GENERATE_BODY, ODD_FIELDS))
DEEP_FORMAT = st.builds(
    lambda deep: {"format": {"type": "object", "properties": {"a": deep}}}, DEEP
)
OLLAMA_DERIVED = {"body", "model", "prompt", "messages", "options"}
"""Names an Ollama 4xx may give besides the body's own fields: the body, required fields
that are missing, the prompt as rendered, options from their defaults (num_predict)."""


def ollama_problems(body: Any, status: int, text: str) -> list[str]:
    """What is wrong with an answer of /api/chat or /api/generate."""
    if status >= 500:
        return [f"{status}: {text[:300]}"]
    if status >= 400:
        try:
            message = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            return [f"{status} without an Ollama error body: {text[:300]}"]
        if not isinstance(message, str):
            return [f"{status} with a malformed error: {text[:300]}"]
        if not starts_with_a_field(message, top_fields(body) | OLLAMA_DERIVED):
            return [f"{status} names no field of the body first in its message: {message[:300]}"]
        return []
    lines = [json.loads(line) for line in text.strip().split("\n")]
    problems = [f"error line: {line}" for line in lines if "error" in line]
    if not lines or lines[-1].get("done") is not True:
        problems.append(f"the last object is not done: ...{text[-300:]}")
    return problems
