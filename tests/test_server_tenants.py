"""Keys and tenants on one server (conftest's keyed_server: the user key from a file, the
admin key from the environment). A namespace is what a request's cache_salt names: a user
sees aggregate counts and its own namespace only, never another's token ids or salt; pins
are their namespace's; admin routes need the admin key; no route shows a key or secret."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import aiohttp
import pytest
from native_http import get, post, run

from conftest import ADMIN_API_KEY, API_KEY, prompt_ids
from radixserve.config import is_secret_field

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_API_KEY}"}
SALT_A, SALT_B = "tenant-a-salt-3141", "tenant-b-salt-2718"
A_IDS, B_IDS, SHARED_IDS = prompt_ids(41, 48), prompt_ids(42, 48), prompt_ids(43, 48)


def as_tenant(salt: str | None) -> dict[str, str]:
    return USER if salt is None else USER | {"X-Cache-Salt": salt}


def previews(tree: dict) -> list[list[int]]:
    return [s["first_token_ids"] for s in tree["largest_subtrees"]]


def test_a_user_sees_aggregates_and_its_own_namespace_only(keyed_server):
    url = keyed_server.url
    for ids, salt in ((A_IDS, SALT_A), (B_IDS, SALT_B), (SHARED_IDS, None)):
        body = {"input_ids": ids, "sampling_params": GREEDY, "cache_salt": salt}
        assert run(post(url + "/generate", body, headers=USER))[0] == 200
    status, tree = run(get(url + "/cache/tree?top_k=100", headers=as_tenant(SALT_B)))
    assert status == 200 and previews(tree) == [B_IDS[:8]]
    assert tree["num_namespaces"] >= 3 and tree["num_tokens"] >= 3 * 48  # everyone's counts
    label = tree["largest_subtrees"][0]["namespace"]
    assert label.startswith("ns-") and SALT_B not in label
    status, tree = run(get(url + "/cache/tree?top_k=100", headers=as_tenant(None)))
    assert A_IDS[:8] not in previews(tree) and B_IDS[:8] not in previews(tree)
    assert SHARED_IDS[:8] in previews(tree)  # no salt: the default namespace, shared
    status, tree = run(get(url + "/cache/tree?top_k=100", headers=ADMIN))
    assert {tuple(p) for p in previews(tree)} >= {tuple(A_IDS[:8]), tuple(B_IDS[:8])}
    assert label in {s["namespace"] for s in tree["largest_subtrees"]}
    assert SALT_A not in json.dumps(tree) and SALT_B not in json.dumps(tree)


def test_pins_of_one_tenant_cannot_replace_or_unpin_anothers(keyed_server):
    url = keyed_server.url

    def pin(ids, salt):
        body = {"input_ids": ids, "name": "tools", "cache_salt": salt}
        return run(post(url + "/cache/pin", body, headers=USER))

    def unpin(salt):
        body = {"name": "tools"} | ({} if salt is None else {"cache_salt": salt})
        return run(post(url + "/cache/unpin", body, headers=USER))[0]

    assert pin(A_IDS, SALT_A)[1]["pinned"]
    status, b_pin = pin(B_IDS, SALT_B)  # the same name: B's own pin, A's stays
    assert status == 200 and b_pin["pinned"] and SALT_B not in json.dumps(b_pin)
    status, listed = run(get(url + "/cache/sessions", headers=as_tenant(SALT_B)))
    assert [(p["name"], p["namespace"]) for p in listed["pins"]] == [
        ("tools", b_pin["pin"]["namespace"])
    ]
    assert listed["num_pins"] >= 2 and listed["pinned_pages"] >= 6
    assert run(get(url + "/cache/sessions", headers=as_tenant(None)))[1]["pins"] == []
    assert unpin(None) == 404  # the default namespace has no "tools"
    assert unpin(SALT_B) == 200 and unpin(SALT_B) == 404
    status, listed = run(get(url + "/cache/sessions", headers=ADMIN))
    tools = [p for p in listed["pins"] if p["name"] == "tools"]
    assert len(tools) == 1 and tools[0]["namespace"] != b_pin["pin"]["namespace"]  # A's
    assert SALT_A not in json.dumps(listed)
    assert unpin(SALT_A) == 200


@pytest.mark.parametrize("own_abort", [{"rid": "job-1"}, {"abort_all": True}])
def test_a_rid_is_its_tenants_own_to_reuse_and_abort(keyed_server, own_abort):
    """Tenant B may use A's running rid for its own request, and aborting that rid or all
    (SGLang's abort_all) as B (salt in the header or none) leaves A's request running; A's
    abort ends it. A's request names its namespace as SGLang's cache_salt + extra_key."""
    url = keyed_server.url
    long_run = {"temperature": 0, "max_new_tokens": 1900, "ignore_eos": True}

    async def abort(session, body: dict, headers: dict) -> None:
        async with session.post(url + "/abort_request", json=body, headers=headers) as resp:
            assert resp.status == 200

    async def scenario() -> tuple[list[dict], int]:
        async with aiohttp.ClientSession() as session:
            salted = {"cache_salt": SALT_A[:6], "extra_key": SALT_A[6:]}  # SALT_A's namespace
            body = {"input_ids": A_IDS, "rid": "job-1", "stream": True} | salted
            async with session.post(
                url + "/generate", json=body | {"sampling_params": long_run}, headers=USER
            ) as stream:
                assert stream.status == 200
                events = [await _next_event(stream)]
                b_body = {"input_ids": B_IDS, "rid": "job-1", "sampling_params": GREEDY}
                async with session.post(
                    url + "/generate", json=b_body | {"cache_salt": SALT_B}, headers=USER
                ) as b_reply:
                    b_status = b_reply.status
                for other in ({"rid": "job-1"}, {"abort_all": True}):
                    await abort(session, other, as_tenant(SALT_B))
                    await abort(session, other, USER)  # the default namespace
                for _ in range(8):  # several steps after both aborts: A still decodes
                    events.append(await _next_event(stream))
                assert events[-1]["meta_info"]["finish_reason"] is None
                async with session.post(url + "/abort_request", json={"extra_key": 5},
                                        headers=USER) as bad:  # fmt: skip
                    assert bad.status == 400 and (await bad.json())["error"]["param"] == "extra_key"
                await abort(session, own_abort | {"cache_salt": SALT_A}, USER)
                while (event := await _next_event(stream)) is not None:
                    events.append(event)
        return events, b_status

    events, b_status = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert b_status == 200
    final = events[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort"
    assert final["completion_tokens"] < long_run["max_new_tokens"]


async def _next_event(stream: aiohttp.ClientResponse) -> dict | None:
    """The next SSE data event of a /generate stream; None at [DONE] or its end."""
    async for line in stream.content:
        line = line.decode().strip()
        if line == "data: [DONE]":
            return None
        if line.startswith("data: "):
            return json.loads(line[len("data: ") :])
    return None


def test_admin_routes_open_to_the_admin_key_only(keyed_server):
    url = keyed_server.url

    def call(method: str, path: str, headers: dict) -> tuple[int, dict]:
        if method == "POST":
            return run(post(url + path, b"", headers=headers))  # bodiless, as SGLang's
        return run(get(url + path, headers=headers))

    for method, path in (("POST", "/flush_cache"), ("GET", "/check_integrity"),
                         ("GET", "/dashboard/stats")):  # fmt: skip
        assert call(method, path, {})[0] == 401
        status, reply = call(method, path, USER)
        assert status == 403 and reply["error"]["param"] == "Authorization", path
        assert call(method, path, ADMIN)[0] == 200, path
    assert run(get(url + "/cache/tree", headers=USER))[0] == 200  # scoped, not refused


def test_server_info_shows_no_key_or_secret(keyed_server):
    status, info = run(get(keyed_server.url + "/server_info", headers=USER))
    assert status == 200
    text = json.dumps(info)
    assert API_KEY not in text and ADMIN_API_KEY not in text and "api_key" not in text

    def names(value) -> list[str]:
        if isinstance(value, dict):
            return [*value, *(n for v in value.values() for n in names(v))]
        return []

    assert [name for name in names(info) if is_secret_field(name)] == []


def test_keys_stay_off_command_lines_and_out_of_the_core_process(keyed_server):
    pid = keyed_server.proc.pid
    for key in (API_KEY, ADMIN_API_KEY):
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    children = [int(p) for p in out.stdout.split()]
    assert children  # the engine core process
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes()
        assert ADMIN_API_KEY.encode() not in environ  # read, then dropped before spawning
