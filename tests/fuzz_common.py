"""What the HTTP fuzz (tests/test_http_fuzz.py) shares across its APIs: hypothesis settings,
junk values, the body mutator, sending a body, and reading an OpenAI-shaped error.

A body may hold a placeholder string of RAW_JSON: `send` writes the raw JSON in its place,
so that a body can carry nesting deeper than the client's own JSON encoder allows.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any

import aiohttp
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

REQUEST_TIMEOUT_S = 30.0
JSON_TYPE = {"Content-Type": "application/json"}  # a keyless server answers 415 without it
MAX_EXAMPLES = int(os.environ.get("RADIXSERVE_FUZZ_EXAMPLES", "60"))  # more: a longer local run
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same bodies on every run: CI failures reproduce
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example is an HTTP call
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PARAM_ROOT = re.compile(r"^[A-Za-z_]+")

DEEP_DEPTH = 600
"""Nesting that Python's JSON parser reads on the server (its limit: ~1000 frames, some taken
by the handler) but that code walking the value recursively does not survive (transformers'
template data: two frames a level, so from ~500 levels)."""
RAW_JSON = {
    "<deep list>": "[" * DEEP_DEPTH + "]" * DEEP_DEPTH,
    "<deep object>": '{"a": ' * DEEP_DEPTH + "1" + "}" * DEEP_DEPTH,
}
"""Placeholder -> the raw JSON `send` writes in its place."""
DEEP = st.sampled_from(sorted(RAW_JSON))
DEEP_TEXT = "[" * 5000 + "]" * 5000
HUGE_INT_TEXT = "9" * 5000
DEEP_ARGUMENTS = '{"a": ' + DEEP_TEXT + "}"
HUGE_ARGUMENTS = '{"a": ' + HUGE_INT_TEXT + "}"
ARGUMENTS = st.sampled_from(['{"a": 1}', "{}"] * 2 + [DEEP_ARGUMENTS, HUGE_ARGUMENTS])
"""Function-call arguments in a valid-ish body: objects, some of which Python's parser
refuses (too deep, an int too long)."""
JSON_TEXTS = ARGUMENTS | st.sampled_from(["[]", "{", "", "null", '{"a": 1e999}'])
"""Function-call arguments in an odd body: also JSON that is not an object, or not JSON."""

# ---- strategies --------------------------------------------------------------------------
# A body is a valid one with, half of the time, one field replaced by an odd value or junk,
# an unknown field added, or nothing valid at all.

ODD_NUMBERS = [-1, 0, 2**31, 2**63, -(2**63) - 1, 10**30, 1.5, -0.0, 1e308, math.nan, math.inf]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.sampled_from(ODD_NUMBERS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
UNKNOWN_FIELDS = st.sampled_from(["bogus", "image_data", "best_of", "suffix", "", "max_tokenz"])
RAW_BODIES = st.binary(max_size=40) | st.sampled_from(
    [
        b"",
        b"{",
        b"\xff\xfe{}",
        b'{"text": "a"',
        b"[" * 5000 + b"]" * 5000,
        b'{"text": "a", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"text": "a", "n": 1e999}',
    ]
)
"""Bodies that are not JSON, or JSON that Python's parser refuses (too deep, too long ints)."""
SMALL_TOKENS = st.integers(0, 4)


def odd(*values: Any) -> st.SearchStrategy:
    """One of `values` (wrong types, out-of-range numbers) or junk."""
    return st.sampled_from(values) | JUNK if values else JUNK


@st.composite
def fuzzed(
    draw, valid: st.SearchStrategy[dict], odd_values: dict[str, st.SearchStrategy], raw: bool = True
):
    """A body from `valid`; half of the time one field gets an odd value, an unknown field is
    added, or the whole body is junk (or, if `raw`, not JSON at all)."""
    body = draw(valid)
    mutations = ["none"] * 10 + ["field"] * 6 + ["unknown"] * 2 + ["junk", "raw" if raw else "junk"]
    mutation = draw(st.sampled_from(mutations))
    if mutation == "field":
        key = draw(st.sampled_from(sorted(odd_values)))
        body[key] = draw(odd_values[key])
    elif mutation == "unknown":
        body[draw(UNKNOWN_FIELDS)] = draw(JUNK)
    elif mutation == "junk":
        body = draw(JUNK)
    elif mutation == "raw":
        body = draw(RAW_BODIES)
    return body


DEEP_KWARGS = st.builds(
    lambda key, deep: {key: deep}, st.sampled_from(["x", "enable_thinking"]), DEEP
)
"""chat_template_kwargs nested deeper than rendering can walk."""
TEMPLATE_KWARGS = st.sampled_from([{"enable_thinking": False}] * 3 + [{"x": "<deep list>"}])
"""chat_template_kwargs in a valid-ish body: thinking off, or nested too deeply."""
ODD_TEMPLATE_KWARGS = DEEP_KWARGS | odd(
    {"chat_template": "{{ x }}"},
    {"tokenize": True},
    {"messages": 1},
    {"tools": 5},
    {"add_generation_prompt": "x"},
    {"continue_final_message": True},
)

# ---- sending and reading an answer -------------------------------------------------------

Problems = Callable[[Any, int, str], list[str]]
"""(body, status, answer text) -> what is wrong with the answer; empty when nothing is."""


def encode(body: Any) -> bytes:
    """`body` as sent: bytes as they are, else JSON with each RAW_JSON placeholder replaced."""
    if isinstance(body, bytes):
        return body
    text = json.dumps(body)
    for placeholder, raw in RAW_JSON.items():
        text = text.replace(json.dumps(placeholder), raw)
    return text.encode()


async def send(url: str, body: Any, headers: dict | None = None) -> tuple[int, str]:
    """POSTs `body` (see `encode`); the status and the whole answer."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url, data=encode(body), headers=JSON_TYPE | (headers or {})) as r:
            return r.status, await r.text()


def check(url: str, body: Any, problems_with: Problems) -> int:
    """Sends `body`; fails on any problem with the answer, else returns its status."""
    status, text = asyncio.run(send(url, body))
    problems = problems_with(body, status, text)
    assert not problems, (repr(body)[:1000], problems)
    return status


def as_sent(body: Any) -> Any:
    """`body` as the server reads it: a raw body parsed (None where it does not parse)."""
    if not isinstance(body, bytes):
        return body
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def top_fields(body: Any) -> set[str]:
    """The top-level fields of `body` (of a raw body too, where it parses)."""
    body = as_sent(body)
    return set(body) if isinstance(body, dict) else set()


def openai_error_problems(fields: set[str], status: int, text: str) -> list[str]:
    """What is wrong with a 4xx in OpenAI's shape whose `param` must name one of `fields`."""
    try:
        error = json.loads(text)["error"]
        message, param = error["message"], error["param"]
    except (ValueError, KeyError, TypeError):
        return [f"{status} without an OpenAI error body: {text[:300]}"]
    if not isinstance(message, str) or not isinstance(param, (str, type(None))):
        return [f"{status} with a malformed error: {error}"]
    if not names_a_field(fields, param):
        return [f"{status} names no field of the body in param: {error}"]
    return []


def names_a_field(fields: set[str], param: str | None) -> bool:
    """`param` is a field as sent (even an odd one), or starts with one (`messages[0].role`)."""
    if param is None:
        return False
    root = PARAM_ROOT.match(param)
    return param in fields or (root is not None and root.group() in fields)


# ---- the server's state afterwards -------------------------------------------------------


async def get_json(url: str, headers: dict | None = None) -> tuple[int, Any]:
    """GETs `url`; the status and the answer's JSON."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)


async def settled_info(url: str) -> dict:
    """/server_info once no request is running or registered (at most ~10 s)."""
    for _ in range(100):
        _, info = await get_json(url + "/server_info")
        if info["num_active_requests"] == 0 and info["stats"]["num_running_reqs"] == 0:
            return info
        await asyncio.sleep(0.1)
    return info


def assert_settled(url: str) -> None:
    """No request is left registered or running, and every KV page is free, in the radix
    tree or held by a running request (/check_integrity): none leaked."""
    info = asyncio.run(settled_info(url))
    assert info["num_active_requests"] == 0, info
    status, integrity = asyncio.run(get_json(url + "/check_integrity"))
    assert status == 200 and integrity["ok"], integrity
