"""The live dashboard: tree summary, sliding windows, `/dashboard/stats` against the engine's
counters, the page behind an API key, and the page itself in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ADMIN_API_KEY, ServerProcess, prompt_ids
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import NoPrefixCache
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import ServerConfig
from radixserve.server.app import build_app
from radixserve.server.dashboard import STATIC_DIR
from radixserve.server.dashboard_stats import TREE_REFRESH_S, DashboardStats
from radixserve.server.sliding_window import CounterWindow, LatencyWindow

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
STATIC_DIR_FILES = ("index.html", "login.html", "dashboard.js", "dashboard.css")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- the tree summary ----------------------------------------------------------------


def make_cache(num_pages: int = 64, page_size: int = 2) -> RadixCache:
    return RadixCache(PageAllocator(num_pages), page_size)


def insert(cache: RadixCache, tokens: list[int]) -> None:
    pages = cache.allocator.allocate(len(tokens) // cache.page_size).tolist()
    present = cache.insert(tokens, pages)
    cache.allocator.free(pages[: present // cache.page_size])


def test_tree_summary_sizes_hits_and_labels():
    cache = make_cache()
    shared = [1, 2, 3, 4, 5, 6]
    insert(cache, shared + [7, 8])
    insert(cache, shared + [9, 10, 11, 12])
    insert(cache, [20, 21])
    for _ in range(3):
        cache.record_hit(cache.match_prefix(shared + [9, 10, 99]).node)
    tree = cache.tree_outline()
    assert tree["subtree_tokens"] == 6 + 2 + 4 + 2
    big, small = tree["children"]
    assert (big["tokens"], big["subtree_tokens"], big["first_ids"]) == (6, 12, shared)
    assert big["hits"] == 3  # split by the match: the upper half keeps every hit
    assert [c["subtree_tokens"] for c in big["children"]] == [4, 2]  # largest first
    assert [c["hits"] for c in big["children"]] == [3, 0]
    assert (small["tokens"], small["first_ids"], small["hits"]) == (2, [20, 21], 0)
    cache.check_integrity()


def test_tree_summary_bounds_nodes_and_counts_what_it_hides():
    cache = make_cache(num_pages=64)
    for i in range(10):
        insert(cache, [1, 1, 100 + i, 0] + [0] * 2 * i)  # 10 branches under one node
    tree = cache.tree_outline(max_nodes=4, max_children=3)
    (root_child,) = tree["children"]
    assert len(root_child["children"]) == 3 and root_child["num_hidden"] == 7
    shown = sum(c["subtree_tokens"] for c in root_child["children"])
    assert shown + root_child["hidden_tokens"] == root_child["subtree_tokens"] - 2
    assert cache.tree_outline(max_nodes=1)["children"][0]["num_hidden"] == 10
    with pytest.raises(ValueError, match="max_nodes"):
        cache.tree_outline(max_nodes=0)


def test_tree_summary_of_no_cache_is_empty():
    tree = NoPrefixCache(PageAllocator(8), 2).tree_outline()
    assert tree["children"] == [] and tree["subtree_tokens"] == 0


# ---- sliding windows -----------------------------------------------------------------


def test_latency_window_percentiles_forget_old_samples():
    clock = FakeClock()
    window = LatencyWindow(window_s=60, max_samples=1000, clock=clock)
    assert window.percentiles().as_dict() == {"count": 0, "p50": None, "p99": None}
    for v in range(1, 101):
        window.observe(float(v))
    p = window.percentiles()
    assert (p.count, p.p50, p.p99) == (100, 50.0, 99.0)
    clock.now += 61
    window.observe(7.0)
    assert window.percentiles().as_dict() == {"count": 1, "p50": 7.0, "p99": 7.0}
    bounded = LatencyWindow(max_samples=10, clock=clock)
    for v in range(50):
        bounded.observe(float(v))
    assert bounded.percentiles().count == 10


def test_counter_window_growth_over_the_last_minute():
    clock = FakeClock()
    window = CounterWindow(window_s=60, min_gap_s=1, clock=clock)
    window.record({"n": 0})
    assert window.growth() is None
    for n in range(1, 200):
        clock.now += 1
        window.record({"n": n})
    seconds, growth = window.growth()
    assert seconds == 60 and growth == {"n": 60}
    clock.now += 0.5  # closer than min_gap_s: replaces the newest snapshot
    window.record({"n": 300})
    assert window.growth()[1] == {"n": 300 - 139} and len(window._snapshots) <= 62


def test_tree_is_refetched_only_after_the_refresh_period():
    clock = FakeClock()
    board = DashboardStats(clock=clock)
    assert board.tree_is_stale()
    board.set_tree({"children": []})
    clock.now += TREE_REFRESH_S / 2
    assert not board.tree_is_stale()
    clock.now += TREE_REFRESH_S / 2
    assert board.tree_is_stale()


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


# ---- a real server -------------------------------------------------------------------


def http(url: str, body=None, headers=None, method=None) -> tuple[int, dict, bytes]:
    """`body`: raw if bytes, else JSON (sent as application/json unless `headers` say)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | (headers or {})
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def stats_of(url: str, headers=None) -> dict:
    status, _, body = http(url + "/dashboard/stats", headers=headers)
    assert status == 200, body
    return json.loads(body)


@pytest.fixture(scope="module")
def fresh_server(tiny_chat_model):
    """A server of this module's own, so that its counters start at zero."""
    proc = ServerProcess(tiny_chat_model)
    yield proc
    proc.stop()


def test_stats_match_engine_counters_after_a_known_workload(fresh_server):
    url = fresh_server.url
    first = stats_of(url)
    assert first["throughput"] is None and first["cache"]["hit_rate_last_minute"] is None
    prefix = prompt_ids(7, 48)  # three pages of 16
    for suffix in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        body = {"input_ids": prefix + suffix, "sampling_params": GREEDY}
        assert http(url + "/generate", body)[0] == 200
    time.sleep(TREE_REFRESH_S)  # the first call's (empty) tree is kept this long
    board = stats_of(url)
    status, _, info = http(url + "/server_info")
    engine = json.loads(info)["stats"]

    cache = board["cache"]
    assert (cache["prompt_tokens"], cache["cached_tokens"]) == (3 * 51, 2 * 48)
    assert cache["prompt_tokens"] == engine["prompt_tokens"]
    assert cache["cached_tokens"] == engine["cached_tokens"]
    assert cache["prefill_tokens_computed"] == engine["prefill_tokens_computed"] == 51 + 2 * 3
    assert cache["hit_rate_since_start"] == pytest.approx(96 / 153)
    assert cache["hit_rate_last_minute"] == pytest.approx(96 / 153)
    throughput = board["throughput"]
    assert throughput["input_tokens_per_s"] * throughput["window_s"] == pytest.approx(153)
    assert throughput["output_tokens_per_s"] * throughput["window_s"] == pytest.approx(
        engine["decode_tokens"]
    )
    assert board["requests"] == {"running": 0, "waiting": 0, "total": 3}
    kv = board["kv_pages"]
    parts = ("free", "tree_evictable", "tree_locked", "tree_pinned", "held")
    assert sum(kv[p] for p in parts) == kv["capacity"]
    assert (kv["free"], kv["held"], kv["tree_locked"]) == (engine["pool_free_pages"], 0, 0)
    assert kv["tree_pinned"] == engine["tree_pinned_pages"] == 0
    assert kv["tree_evictable"] == engine["tree_pages"] == 3
    latency = board["latency"]
    assert latency["window_s"] == 60
    for name in ("ttft", "e2e"):
        assert latency[name]["count"] == 3 and 0 < latency[name]["p50"] <= latency[name]["p99"]
    assert 0 < latency["itl"]["count"] <= 3 * 3  # tokens arriving together count once each
    assert board["pressure"]["retractions"] == engine["retractions"] == 0
    assert board["speculative"] is None
    (node,) = board["tree"]["children"]
    assert (node["subtree_tokens"], node["hits"], node["first_ids"]) == (48, 2, prefix[:8])
    assert isinstance(node["label"], str) and node["label"]


def test_stats_tree_refreshes_at_most_every_two_seconds(fresh_server):
    url = fresh_server.url
    before = stats_of(url)["tree"]
    body = {"input_ids": prompt_ids(8, 40), "sampling_params": GREEDY}
    assert http(url + "/generate", body)[0] == 200
    time.sleep(TREE_REFRESH_S)
    assert len(stats_of(url)["tree"]["children"]) == len(before["children"]) + 1


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


def test_stats_show_speculative_counters_when_it_is_on(tiny_chat_model):
    """In process (TestClient over an Engine): the speculative section mirrors the core."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from conftest import make_engine
    from radixserve.server.metrics import ServerMetrics
    from radixserve.server.state import ServerState

    engine = make_engine(tiny_chat_model, speculative_algorithm="NGRAM")
    state = ServerState(
        client=engine.client,
        builder=engine.builder,
        tokenizer=engine.tokenizer,
        config=ServerConfig(),
        engine_args={"speculative_algorithm": "NGRAM"},
        model_path=tiny_chat_model,
        served_model_name="tiny",
        max_running_requests=256,
        metrics=ServerMetrics(),
    )
    repeating = {"input_ids": [5, 6, 7, 8] * 12, "sampling_params": GREEDY | {"max_new_tokens": 24}}

    async def run():
        async with TestClient(TestServer(build_app(state))) as client:
            assert (await client.post("/generate", json=repeating)).status == 200
            return await (await client.get("/dashboard/stats")).json()

    try:
        board = asyncio.run(run())
        engine_stats = engine.get_stats()
    finally:
        engine.shutdown()
    spec = board["speculative"]
    assert spec["draft_tokens"] == engine_stats["spec_draft_tokens"]
    assert spec["accepted_tokens"] == engine_stats["spec_accepted_tokens"]
    assert spec["accept_length"] == pytest.approx(engine_stats["spec_accept_length"])
    assert spec["draft_tokens"] > 0  # the repeating prompt gives the n-gram drafter matches
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
    assert board["model"] == "tiny" and board["requests"]["total"] == 1


# ---- the Grafana dashboard -----------------------------------------------------------

GRAFANA = Path(__file__).parents[1] / "deploy" / "grafana"


def test_grafana_dashboard_is_generated_and_queries_exported_metrics():
    import importlib.util
    import re

    from prometheus_client.parser import text_string_to_metric_families

    from radixserve.server.metrics import ServerMetrics

    spec = importlib.util.spec_from_file_location("make_dashboard", GRAFANA / "make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shipped = json.loads((GRAFANA / "radixserve.json").read_text())
    assert shipped == module.dashboard(), "rerun deploy/grafana/make_dashboard.py"

    exported = {
        sample.name
        for family in text_string_to_metric_families(ServerMetrics().render({}).decode())
        for sample in family.samples
    }
    exprs = [t["expr"] for p in shipped["panels"] for t in p.get("targets", [])]
    queried = {name for expr in exprs for name in re.findall(r"radixserve:[a-z0-9_]+", expr)}
    assert len(queried) >= 15 and queried <= exported, queried - exported
    ids = [p["id"] for p in shipped["panels"]]
    assert len(ids) == len(set(ids))
