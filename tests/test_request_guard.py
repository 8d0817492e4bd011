"""A server without a key (the default) against browser attacks: DNS rebinding (a foreign
Host), cross-site requests (a foreign Origin, text/plain or form bodies)."""

from __future__ import annotations

import aiohttp
from native_http import get, post, run

from conftest import prompt_ids

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
BODY = {"input_ids": prompt_ids(1), "sampling_params": GREEDY}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def error_of(reply: dict) -> tuple[int, str, str]:
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}  # OpenAI's error shape
    return error["code"], error["type"], error["param"]


def test_a_rebinding_host_or_a_foreign_origin_gets_403(server):
    url = server.url
    for headers in ({"Host": "evil.example"}, {"Host": f"rebind.evil.example:{server.port}"}):
        status, reply = run(post(url + "/generate", BODY, headers=headers))
        assert status == 403 and error_of(reply)[2] == "Host"
        status, reply = run(get(url + "/server_info", headers=headers))  # reading, too
        assert status == 403 and "evil.example" in reply["error"]["message"]
    for origin in ("http://evil.example", "null", f"http://127.0.0.1.evil.example:{server.port}"):
        status, reply = run(post(url + "/v1/chat/completions", CHAT, headers={"Origin": origin}))
        assert status == 403 and error_of(reply) == (403, "PermissionDeniedError", "Origin")
    loopback = {"Host": f"localhost:{server.port}", "Origin": f"http://[::1]:{server.port}"}
    assert run(post(url + "/generate", BODY, headers=loopback))[0] == 200
    assert run(get(url + "/health", headers={"Host": "evil.example"}))[0] == 200  # probes


def test_a_body_that_is_not_json_gets_415_and_a_bodiless_post_passes(server):
    url = server.url

    async def post_as(path: str, data, content_type: str | None):
        headers = {} if content_type is None else {"Content-Type": content_type}
        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, data=data, headers=headers) as resp:
                return resp.status, await resp.json(content_type=None)

    plain = '{"input_ids": [1, 2, 3]}'
    status, reply = run(post_as("/generate", plain, "text/plain"))  # a form can send this
    assert status == 415 and error_of(reply)[2] == "Content-Type"
    status, reply = run(post_as("/v1/chat/completions", plain, "text/plain"))
    assert status == 415 and error_of(reply) == (415, "UnsupportedMediaTypeError", "Content-Type")
    status, reply = run(
        post_as("/cache/pin", b"name=x&text=y", "application/x-www-form-urlencoded")
    )
    assert status == 415 and "application/x-www-form-urlencoded" in reply["error"]["message"]
    assert run(post_as("/abort_request", b'{"rid": "x"}', None))[0] == 415  # no type at all

    async def flush() -> tuple[int, str]:  # SGLang's clients post it empty
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/flush_cache") as resp:
                return resp.status, await resp.text()

    assert run(flush()) == (200, "Cache flushed.\n")


def test_the_dashboard_login_form_is_guarded_by_its_origin(server):
    form = {"Content-Type": "application/x-www-form-urlencoded"}

    async def login(origin: str) -> int:
        headers = form | {"Origin": origin}
        async with aiohttp.ClientSession() as session:
            request = session.post(
                server.url + "/dashboard/login",
                data=b"key=",
                headers=headers,
                allow_redirects=False,
            )
            async with request as resp:
                return resp.status

    assert run(login("http://evil.example")) == 403
    assert run(login(f"http://127.0.0.1:{server.port}")) == 303  # no key set: the page


def test_a_file_upload_is_guarded_by_its_origin(server):
    """/v1/files takes OpenAI's multipart uploads without a key; a foreign page's is a 403."""

    async def upload(origin: str | None) -> int:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b"{}\n", filename="in.jsonl")
        headers = {} if origin is None else {"Origin": origin}
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/files", data=form, headers=headers) as resp:
                return resp.status

    assert run(upload("http://evil.example")) == 403
    assert run(upload(None)) == run(upload(f"http://127.0.0.1:{server.port}")) == 200
