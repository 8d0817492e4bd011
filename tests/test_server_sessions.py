"""SGLang's sessions: /open_session, /close_session and /generate's session_params against
conftest's shared `server`, and the store's bounds (server/sessions.py) on its own."""

from __future__ import annotations

import json

import pytest
from native_http import GREEDY, post, run

from radixserve.server.errors import BadRequest
from radixserve.server.sessions import SessionStore


def generate(server, **body) -> dict:
    status, out = run(post(server.url + "/generate", {"sampling_params": GREEDY} | body))
    assert status == 200, out
    return out


def open_session(server, **body) -> str:
    """SGLang's /open_session: the id, as a JSON string."""
    status, text = run(post(server.url + "/open_session", body))
    assert status == 200, text
    return json.loads(text)


def test_a_session_continues_its_requests_from_their_tokens(server):
    sid = open_session(server, capacity_of_str_len=1000)
    first_ids = [(j * 37 + 5) % 3000 + 400 for j in range(40)]
    first = generate(server, input_ids=first_ids, session_params={"id": sid})
    turn = [901, 902, 903]
    cont = {"id": sid, "rid": first["meta_info"]["id"]}
    second = generate(server, input_ids=turn, session_params=cont, return_prompt_token_ids=True)
    assert second["prompt_token_ids"] == first_ids + first["output_ids"] + turn
    assert second["meta_info"]["cached_tokens"] >= 32  # the radix cache serves the history
    plain = generate(server, input_ids=first_ids + first["output_ids"] + turn)
    assert second["output_ids"] == plain["output_ids"]
    dropped = cont | {"drop_previous_output": True, "offset": 30}
    third = generate(server, input_ids=turn, session_params=dropped, return_prompt_token_ids=True)
    assert third["prompt_token_ids"] == first_ids[:30] + turn
    after_third = {"id": sid, "rid": third["meta_info"]["id"]}
    text = generate(server, text=" next", session_params=after_third, return_prompt_token_ids=True)
    assert text["prompt_token_ids"][:33] == first_ids[:30] + turn
    status, _ = run(post(server.url + "/close_session", {"session_id": sid}))
    assert status == 200
    status, out = run(post(server.url + "/generate", {"input_ids": turn, "session_params": cont}))
    assert status == 404 and out["error"]["param"] == "session_params.id"


def test_sessions_are_their_namespaces_own_and_bad_input_is_named(server):
    sid = open_session(server, cache_salt="tenant-x")
    body = {"input_ids": [500] * 20, "sampling_params": GREEDY, "session_params": {"id": sid}}
    status, out = run(post(server.url + "/generate", body))  # another namespace: not found
    assert status == 404 and out["error"]["param"] == "session_params.id"
    status, first = run(post(server.url + "/generate", body | {"cache_salt": "tenant-x"}))
    assert status == 200
    unknown = {"id": sid, "rid": "no-such-rid"}
    cases = [
        ({"session_params": unknown, "cache_salt": "tenant-x"}, 404, "session_params.rid"),
        ({"session_params": {"id": sid, "bogus": 1}}, 400, "session_params"),
        ({"session_params": {"id": sid, "offset": "1"}, "cache_salt": "tenant-x"}, 400,
         "session_params.offset"),
        ({"session_params": {"id": sid}, "input_ids": [[1], [2]], "cache_salt": "tenant-x"}, 400,
         "session_params"),
        ({"session_params": {"id": sid}, "cache_salt": "tenant-x",
          "sampling_params": GREEDY | {"n": 2}}, 400, "session_params"),
    ]  # fmt: skip
    for extra, code, param in cases:
        status, out = run(post(server.url + "/generate", body | extra))
        assert status == code and out["error"]["param"] == param, (extra, out)
    status, out = run(
        post(server.url + "/open_session", {"session_id": sid, "cache_salt": "tenant-x"})
    )
    assert status == 400 and out["error"]["param"] == "session_id"  # already open
    conflicting = post(server.url + "/open_session", {"cache_salt": "tenant-x"},
                       headers={"X-Cache-Salt": "tenant-y"})  # fmt: skip
    status, out = run(conflicting)  # the namespace is named once, as on every chat API
    assert status == 400 and out["error"]["param"] == "cache_salt"
    status, out = run(post(server.url + "/open_session", {"streaming": True}))
    assert status == 400 and out["error"]["param"] == "streaming"
    assert run(post(server.url + "/close_session", {"session_id": sid}))[0] == 404  # not its own
    close = {"session_id": sid, "cache_salt": "tenant-x"}
    assert run(post(server.url + "/close_session", close))[0] == 200


def test_the_store_is_bounded_in_sessions_tokens_and_idle_time():
    now = [0.0]
    store = SessionStore(max_sessions=2, max_tokens=100, clock=lambda: now[0])
    a = store.open(None, {"timeout": 10})
    b = store.open(None, {})
    with pytest.raises(BadRequest) as exc:
        store.open(None, {})
    assert exc.value.status == 429
    _, where = store.continue_prompt(None, {"id": b}, [1])
    for i in range(4):  # 4 x 40 tokens: the oldest turns are forgotten past 100
        store.record(where, f"r{i}", [7] * 30, [8] * 10)
    assert store.num_tokens == 80
    with pytest.raises(BadRequest) as exc:
        store.continue_prompt(None, {"id": b, "rid": "r0"}, [1])
    assert exc.value.status == 404
    ids, _ = store.continue_prompt(None, {"id": b, "rid": "r3", "offset": -5}, [1])
    assert ids == [7] * 30 + [8] * 5 + [1]
    now[0] = 11.0  # `a` idles past its timeout: closed, its slot free again
    assert len(store) == 1 and store.open(None, {"session_id": a}) == a
    assert store.close(None, b) and store.num_tokens == 0 and not store.close(None, b)
