"""Fuzzing the HTTP API: hypothesis bodies for /generate, /v1/completions,
/v1/chat/completions, the agent APIs /v1/messages and /v1/responses (their bodies and
checks: fuzz_agent_apis.py) and Ollama's /api/chat and /api/generate (fuzz_ollama_api.py),
valid-ish and not, against one server that separates reasoning
(`--reasoning-parser`) and reads tool calls.

Every answer must be a 2xx (a stream ending in `data: [DONE]`, no request aborted by an
internal error) or a 4xx whose JSON error's `param` names the offending field; never a 5xx
or a hang.
Afterwards no request is left registered and no KV page is leaked.

The server's context is short (CONTEXT_LENGTH, room for a tools prompt of ~170 tokens) so
that even a body without max_tokens ends quickly; the strategies draw small token counts
most of the time (the completion APIs' bodies and checks: fuzz_completion_apis.py). Bodies
once answered wrongly: fuzz_regressions.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fuzz_agent_apis import (
    MESSAGES_BODY,
    MESSAGES_PATH,
    R_CALL,
    R_OUTPUT,
    RESPONSES_BODY,
    anthropic_problems,
    for_path,
    responses_problems,
    with_previous,
)
from fuzz_common import FUZZ_SETTINGS, assert_settled, get_json, send
from fuzz_common import check as check_with
from fuzz_completion_apis import (
    CHAT_BODY,
    COMPLETION_BODY,
    GENERATE_BODY,
    SCORE_CASES,
    check,
    problems_with,
    score_problems,
)
from fuzz_embeddings import embedding_problems, rerank_cases
from fuzz_lifecycle import (  # noqa: F401 (collected here, against this file's server)
    stored_ids,
    test_fuzz_disconnect_mid_stream,
    test_fuzz_stored_response_ids,
)
from fuzz_ollama_api import DEEP_FORMAT, OLLAMA_BODY, OLLAMA_PATH, ollama_problems
from fuzz_regressions import REGRESSIONS
from hypothesis import given

from conftest import ServerProcess

CONTEXT_LENGTH = 256


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_model):
    proc = ServerProcess(
        tiny_chat_model,
        "--served-model-name",
        "tiny",
        "--context-length",
        str(CONTEXT_LENGTH),
        "--max-total-tokens",
        "2048",
        "--max-running-requests",
        "8",
        "--max-queued-requests",
        "64",
        "--reasoning-parser",
        "deepseek-r1",
        "--tool-call-parser",
        "qwen25",
    )
    yield proc
    try:
        assert proc.stop() == 0  # a request left registered would hang the shutdown
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()


# ---- the fuzz ----------------------------------------------------------------------------


@FUZZ_SETTINGS
@given(body=GENERATE_BODY)
def test_fuzz_generate(fuzz_server, body):
    check(fuzz_server.url + "/generate", body)


@FUZZ_SETTINGS
@given(body=COMPLETION_BODY)
def test_fuzz_completions(fuzz_server, body):
    check(fuzz_server.url + "/v1/completions", body)


@FUZZ_SETTINGS
@given(body=CHAT_BODY)
def test_fuzz_chat_completions(fuzz_server, body):
    check(fuzz_server.url + "/v1/chat/completions", body)


@FUZZ_SETTINGS
@given(body=SCORE_CASES)
def test_fuzz_score(fuzz_server, body):
    check_with(fuzz_server.url + "/v1/score", body, score_problems)


@FUZZ_SETTINGS
@given(case=rerank_cases("tiny"))
def test_fuzz_rerank(fuzz_server, case):
    path, body = case
    check_with(fuzz_server.url + path, body, embedding_problems(path))


AGENT_PROBLEMS = {
    "/v1/messages": anthropic_problems,
    "/v1/messages/count_tokens": anthropic_problems,
    "/v1/responses": responses_problems,
}
"""How the agent APIs' answers are checked; every other path's as problems_with."""


@FUZZ_SETTINGS
@given(path=MESSAGES_PATH, body=MESSAGES_BODY)
def test_fuzz_anthropic_messages(fuzz_server, path, body):
    check_with(fuzz_server.url + path, for_path(path, body), anthropic_problems)


@FUZZ_SETTINGS
@given(path=OLLAMA_PATH, body=OLLAMA_BODY)
def test_fuzz_ollama(fuzz_server, path, body):
    check_with(fuzz_server.url + path, body, ollama_problems)


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
@FUZZ_SETTINGS
@given(extra=DEEP_FORMAT)
def test_fuzz_ollama_deep_format(fuzz_server, path, extra):
    body = {"model": "tiny", "messages": [], "prompt": "", "stream": False} | extra
    body = {k: v for k, v in body.items() if k != ("prompt" if path == "/api/chat" else "messages")}
    check_with(fuzz_server.url + path, body, ollama_problems)


@pytest.fixture(scope="module")
def stored_response_id(fuzz_server) -> str:
    """A stored response (with a tool call in its history) that bodies may continue."""
    body = {"model": "tiny", "input": [R_CALL, R_OUTPUT], "max_output_tokens": 2}
    status, text = asyncio.run(send(fuzz_server.url + "/v1/responses", body))
    assert status == 200, text
    return json.loads(text)["id"]


@FUZZ_SETTINGS
@given(body=RESPONSES_BODY)
def test_fuzz_responses(fuzz_server, stored_response_id, body):
    body = with_previous(body, stored_response_id)
    check_with(fuzz_server.url + "/v1/responses", body, responses_problems)


@pytest.mark.parametrize("path, body, status", REGRESSIONS)
def test_regressions(fuzz_server, path, body, status):
    problems = AGENT_PROBLEMS.get(path, problems_with)
    assert check_with(fuzz_server.url + path, body, problems) == status


def test_zz_after_the_fuzz_nothing_leaks(fuzz_server):
    """Runs after the fuzz (pytest keeps file order): no registered request, no lost page."""
    url = fuzz_server.url
    assert_settled(url)
    assert asyncio.run(send(url + "/flush_cache", {}))[0] == 200
    _, integrity = asyncio.run(get_json(url + "/check_integrity"))
    assert integrity["pool_free_pages"] == integrity["pool_capacity_pages"], integrity
    assert fuzz_server.proc.poll() is None
