"""The live dashboard's page: its routes (gone with --disable-dashboard), its static files,
the login behind an API key with a session cookie (conftest's `keyed_server`), and the page
itself in headless Chromium under load."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from dashboard_http import GREEDY, http, stats_of

from conftest import ADMIN_API_KEY
from radixserve.config import ServerConfig
from radixserve.server.app import build_app
from radixserve.server.dashboard import STATIC_DIR

STATIC_DIR_FILES = ("index.html", "login.html", "dashboard.js", "dashboard.css")


# ---- routes without a server ---------------------------------------------------------


def test_disable_dashboard_removes_its_routes():
    def paths(config):
        app = build_app(SimpleNamespace(config=config))
        return {route.resource.canonical for route in app.router.routes()}

    assert "/dashboard" in paths(ServerConfig())
    assert not {p for p in paths(ServerConfig(disable_dashboard=True)) if "dashboard" in p}


def test_static_files_ship_and_the_script_parses():
    for name in STATIC_DIR_FILES:
        assert (STATIC_DIR / name).stat().st_size > 0
    index = (STATIC_DIR / "index.html").read_text()
    assert "/dashboard/dashboard.js" in index and "/dashboard/dashboard.css" in index
    assert "<script>" not in index and "style=" not in index  # the CSP forbids inline code
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the script's syntax is checked in the browser test")
    subprocess.run([node, "--check", str(STATIC_DIR / "dashboard.js")], check=True)


# ---- behind an API key ---------------------------------------------------------------


def test_page_behind_api_key_uses_a_session_cookie(keyed_server):
    url = keyed_server.url
    status, headers, body = http(url + "/dashboard")
    assert status == 401 and b'<form method="post" action="/dashboard/login">' in body
    assert "sekret" not in body.decode()
    assert http(url + "/dashboard/stats")[0] == 401
    assert http(url + "/dashboard/dashboard.js")[0] == 401
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert http(url + "/dashboard/login", b"key=wrong", form)[0] == 401
    assert http(url + "/dashboard/login", b"key=sekret", form)[0] == 401  # the user's key
    login = f"key={ADMIN_API_KEY}".encode()
    status, headers, _ = http_no_redirect(url + "/dashboard/login", login, form)
    assert status == 303 and headers["Location"] == "/dashboard"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/dashboard" in cookie
    assert "sekret" not in cookie
    session = {"Cookie": cookie.split(";")[0]}
    assert http(url + "/dashboard", headers=session)[0] == 200
    status, headers, _ = http(url + "/dashboard/dashboard.js", headers=session)
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert stats_of(url, session)["requests"]["running"] == 0
    assert stats_of(url, {"Authorization": f"Bearer {ADMIN_API_KEY}"})["requests"]["running"] == 0
    user = {"Authorization": "Bearer sekret"}
    assert http(url + "/dashboard/stats", headers=user)[0] == 403  # every tenant's prompts
    body = {"input_ids": [1, 2, 3], "sampling_params": GREEDY}
    assert http(url + "/generate", body, session)[0] == 401  # the cookie is for the page only
    assert http(url + "/dashboard/nothing.js", headers=session)[0] == 404


def http_no_redirect(url: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, data=body, headers=headers), timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


# ---- the page in a real browser ------------------------------------------------------

SYSTEM = (
    "You are a careful assistant for a library. Answer in one short sentence, cite the shelf "
    "number when you know it, and say so plainly when you do not know the answer."
)


UNAUTHORIZED_MESSAGE = (
    "error: Failed to load resource: the server responded with a status of 401 (Unauthorized)"
)


def find_browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


@pytest.fixture
def browser_path() -> str:
    """The system's Chromium, driven by Playwright (whose own browser downloads need the
    internet); skipped with the reason when either is missing."""
    path = find_browser()
    if path is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip)")
    return path


def send_load(url: str, key: str, num_requests: int = 12, num_threads: int = 3) -> None:
    """A small bounded load: questions after one shared system prompt."""

    def worker(first: int) -> None:
        for i in range(first, num_requests, num_threads):
            body = {
                "text": f"{SYSTEM}\nQuestion {i}: where is book {i}?",
                "sampling_params": GREEDY,
            }
            http(url + "/generate", body, {"Authorization": f"Bearer {key}"})

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_dashboard_in_headless_chromium(keyed_server, browser_path, tmp_path):
    from playwright.sync_api import sync_playwright

    proc = keyed_server
    console: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path)
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        page.goto(proc.url + "/dashboard")
        # the form's autofocus runs at a later frame: filling first (which focuses the field)
        # makes Chromium log that autofocus was blocked, so wait for it to have run
        page.wait_for_function("() => document.activeElement?.name === 'key'")
        page.fill("input[name=key]", ADMIN_API_KEY)
        page.click("button[type=submit]")
        page.wait_for_function(
            "() => document.querySelector('#status').textContent.startsWith('updated')"
        )
        assert "sekret" not in page.url and page.url.endswith("/dashboard")
        # the login form's own answer is a 401, which the browser reports; nothing else may
        login_messages, console[:] = console[:], []
        assert login_messages == [UNAUTHORIZED_MESSAGE], login_messages
        before = page.text_content("#prompt-tokens")
        load = threading.Thread(target=send_load, args=(proc.url, "sekret"))
        load.start()
        prompt_tokens = "document.querySelector('#prompt-tokens').textContent"
        page.wait_for_function(f"() => {prompt_tokens} !== {json.dumps(before)}")
        load.join()
        page.wait_for_function(
            "() => [...document.querySelectorAll('#tree text')]"
            ".some(t => t.textContent.includes('You are a careful'))",
            timeout=15_000,
        )
        page.wait_for_function("() => document.querySelector('#tok-in').textContent !== '–'")
        assert page.text_content("#hit-rate-total") not in ("–", "0.0%")
        assert int(page.text_content("#prompt-tokens").replace(",", "")) > int(before)
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert console == [], "\n".join(console)
