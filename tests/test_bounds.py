"""Bounds on what clients can make the server keep: pins by count and name length, compiled
grammars, dashboard login attempts, tree summaries (units and an in-process app; a running
server's bounds: test_server_bounds.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_retention import FakeClock, insert
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from conftest import make_core
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.retention import (
    MAX_PIN_NAME_CHARS,
    PinTable,
    check_pin_name,
    prefix_pin_key,
    session_pin_key,
)
from radixserve.config import SchedulerConfig, ServerConfig
from radixserve.config.disaggregation import is_loopback_host
from radixserve.engine import scheduler as scheduler_module
from radixserve.sampling.grammar import GrammarBackend
from radixserve.server import auth
from radixserve.server.app import build_app
from radixserve.server.auth import KEY_THROTTLE_KEY
from radixserve.server.dashboard import FORM, LOGIN_PATH, THROTTLE_KEY
from radixserve.server.limits import (
    API_KEY_MAX_FAILURES,
    LOGIN_MAX_BODY_BYTES,
    LOGIN_MAX_FAILURES,
    LoginThrottle,
)
from radixserve.server.ttl_cache import TtlCache

TOKENS = [1, 2, 3, 4]


def pin_table(max_pins: int) -> tuple[RadixCache, PinTable]:
    allocator = PageAllocator(16)
    cache = RadixCache(allocator, 1)
    insert(cache, allocator, TOKENS)
    return cache, PinTable(cache, 16, max_pins=max_pins)


def names(table: PinTable) -> list[str]:
    return [pin["name"] for pin in table.describe()]


def test_ten_thousand_pin_names_stop_at_the_count_cap_and_the_first_ones_stay():
    cache, table = pin_table(max_pins=100)
    pinned = [table.pin(prefix_pin_key(f"p{i}"), TOKENS) for i in range(10_000)]
    assert all(pinned[:100]) and not any(pinned[100:])
    assert len(table) == 100 and table.num_refused == 9_900 and table.is_full()
    assert names(table) == [f"p{i}" for i in range(100)]
    assert table.pin(prefix_pin_key("p7"), TOKENS) is not None  # a live name renews, no new pin
    assert table.unpin(prefix_pin_key("p0")) and table.pin(prefix_pin_key("late"), TOKENS)
    assert len(table) == 100
    table.clear()
    assert cache.num_pinned_pages() == 0  # nothing refused was left pinned


def test_sessions_past_the_cap_end_the_oldest_session_and_prefix_pins_come_first():
    cache, table = pin_table(max_pins=3)
    for i in range(1_000):
        assert table.pin(session_pin_key(f"s{i}"), TOKENS) is not None
    assert names(table) == ["s997", "s998", "s999"] and table.num_degraded == 997
    for name in "abc":  # each takes the place of the oldest session
        assert table.pin(prefix_pin_key(name), TOKENS) is not None
    assert names(table) == ["a", "b", "c"] and not table.num_refused
    assert table.pin(session_pin_key("late"), TOKENS) is None and table.num_refused == 1
    table.clear()
    assert cache.num_pinned_pages() == 0


def test_pin_names_are_bounded_in_length():
    assert check_pin_name("x" * MAX_PIN_NAME_CHARS, "name")
    with pytest.raises(ValueError, match=f"session_id must be at most {MAX_PIN_NAME_CHARS}"):
        check_pin_name("x" * (MAX_PIN_NAME_CHARS + 1), "session_id")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        check_pin_name("", "name")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level vocabulary of a few symbols: a grammar over it compiles at once (one over
    SmolLM2's 49k tokens takes seconds)."""
    words = ["</s>", "a", "b", "ab", "(", ")"]
    model = models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="</s>")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model), eos_token="</s>")


def test_the_grammar_cache_stays_at_its_cap_failed_compiles_included():
    backend = GrammarBackend(tiny_tokenizer(), 6, (0,), max_entries=3)
    broken = backend.compile_async("regex", "(")
    with pytest.raises(ValueError, match="regex is invalid"):
        broken.result(timeout=60)
    assert backend.compile_async("regex", "(") is broken  # a failure is cached too
    valid = [backend.compile_async("regex", f"a{{{i}}}b") for i in range(1, 6)]
    invalid = [backend.compile_async("regex", "(" * i) for i in range(2, 6)]
    assert len(backend) == 3 and backend.stats.cache_evictions == 7
    assert backend.stats.compiles == 10 and backend.stats.cache_hits == 1
    for future in valid:  # evicted while compiling or after: each still finishes
        future.result(timeout=60)
    assert all(isinstance(f.exception(timeout=60), ValueError) for f in invalid)
    assert backend.compile_async("regex", "(") is not broken  # evicted: compiled again
    matcher = backend.matcher(valid[-1].result())
    assert matcher.accept_string("aaaaab") and not matcher.accept_string("a")


def test_grammar_cache_size_reaches_the_backend(tiny_chat_model, monkeypatch):
    core = make_core(tiny_chat_model, grammar_cache_size=3)
    monkeypatch.setattr(scheduler_module, "GrammarBackend", lambda *args: args)
    assert core.scheduler.grammar[-1] == 3
    with pytest.raises(ValueError, match="grammar_cache_size must be >= 1"):
        SchedulerConfig(grammar_cache_size=0).verify()


def test_login_throttle_counts_failures_per_address_in_a_window_and_forgets_old_addresses():
    clock = FakeClock()
    throttle = LoginThrottle(max_failures=3, window_s=60, max_addresses=16, clock=clock)
    for _ in range(2):
        throttle.record_failure("a")
    assert throttle.retry_after("a") is None
    throttle.record_failure("a")
    assert throttle.retry_after("a") == 60 and throttle.retry_after("b") is None
    clock.now = 45.0
    assert throttle.retry_after("a") == 15
    clock.now = 60.0
    assert throttle.retry_after("a") is None
    for i in range(10_000):
        throttle.record_failure(f"10.0.{i // 256}.{i % 256}")
    assert len(throttle) == 16


def test_dashboard_login_reads_a_small_form_and_throttles_wrong_keys():
    app = build_app(SimpleNamespace(config=ServerConfig(api_key="sekret")))
    form = {"Content-Type": FORM}

    async def login(client, data, **kwargs):
        resp = await client.post(LOGIN_PATH, data=data, allow_redirects=False, **kwargs)
        return resp.status, resp.headers, await resp.text()

    async def chunks():
        yield b"key=sekret"

    async def go():
        async with TestClient(TestServer(app)) as client:
            too_long = b"key=" + b"x" * LOGIN_MAX_BODY_BYTES
            status, _, body = await login(client, too_long, headers=form)
            assert status == 413 and '"param": "body"' in body
            assert (await login(client, chunks(), headers=form))[0] == 411
            for _ in range(LOGIN_MAX_FAILURES - 1):
                assert (await login(client, b"key=wrong", headers=form))[0] == 401
            status, headers, body = await login(client, b"key=wrong", headers=form)
            assert status == 429 and int(headers["Retry-After"]) >= 59 and "try again" in body
            assert (await login(client, b"key=sekret", headers=form))[0] == 429  # not compared
            bearer = {"Authorization": "Bearer sekret"}
            assert (await client.get("/dashboard", headers=bearer)).status == 200
            app[THROTTLE_KEY].clock = lambda: 1e9  # the window has passed
            assert (await login(client, b"key=sekret", headers=form))[0] == 303

    asyncio.run(go())


def test_wrong_api_keys_are_throttled_per_address_before_any_comparison(monkeypatch):
    app = build_app(SimpleNamespace(config=ServerConfig(api_key="sekret")))
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1")
    assert is_loopback_host("::ffff:127.0.0.1")  # an IPv4 peer of a dual-stack socket
    assert not is_loopback_host("10.0.0.7") and not is_loopback_host("::ffff:10.0.0.7")
    assert not is_loopback_host("")  # a unix socket's peer: not an address
    monkeypatch.setattr(auth, "is_loopback_host", lambda address: False)  # as if from afar

    async def status(client, headers: dict) -> tuple[int, dict]:
        resp = await client.get("/v1/models", headers=headers)
        return resp.status, resp.headers

    async def go():
        async with TestClient(TestServer(app)) as client:
            wrong = [{"Authorization": f"Bearer guess-{i}"} for i in range(API_KEY_MAX_FAILURES)]
            wrong[1] = {"x-api-key": "guess-x"}  # Anthropic's header counts as well
            for headers in wrong:
                assert (await status(client, headers))[0] == 401
            code, headers = await status(client, {"Authorization": "Bearer sekret"})
            assert code == 429 and int(headers["Retry-After"]) >= 59  # the right key: too
            assert (await status(client, {}))[0] == 401  # no key: nothing to guess with
            app[KEY_THROTTLE_KEY].clock = lambda: 1e9  # the window has passed
            assert (await status(client, {"Authorization": "Bearer sekret"}))[0] != 401

    asyncio.run(go())


def test_ttl_cache_makes_one_call_per_key_and_ttl_however_many_ask():
    clock = FakeClock()
    cache = TtlCache(ttl_s=1.0, max_entries=2, clock=clock)
    calls = []

    async def fetch():
        calls.append(clock.now)
        await asyncio.sleep(0.01)
        return len(calls)

    async def failing():
        raise RuntimeError("core gone")

    async def go():
        assert await asyncio.gather(*[cache.get("tree", fetch) for _ in range(50)]) == [1] * 50
        clock.now = 0.9
        assert await cache.get("tree", fetch) == 1
        clock.now = 1.0
        assert await cache.get("tree", fetch) == 2
        with pytest.raises(RuntimeError):
            await cache.get("other", failing)
        assert len(cache) == 1  # a failure is not kept
        for key in range(10):
            await cache.get(key, fetch)
        assert len(cache) == 2

    asyncio.run(go())
    assert cache.num_fetches == 13


def insert_in(cache: RadixCache, allocator: PageAllocator, tokens: list[int], namespace) -> None:
    pages = allocator.allocate(len(tokens)).tolist()
    allocator.free(pages[: cache.insert(tokens, pages, namespace)])


def test_a_tenant_alone_fills_the_pin_cap_and_others_take_back_their_share():
    cache, table = pin_table(max_pins=10)
    for namespace in "AB":
        insert_in(cache, cache.allocator, TOKENS, namespace)
    for i in range(10):
        assert table.pin(prefix_pin_key(f"a{i}"), TOKENS, namespace="A") is not None
    assert table.is_full("A") and not table.is_full("B")
    for i in range(20):  # B displaces A's oldest prefix pins until the counts are level
        table.pin(prefix_pin_key(f"b{i}"), TOKENS, namespace="B")
    by_namespace = [pin["namespace"] for pin in table.describe()]
    assert by_namespace.count("A") == 5 and by_namespace.count("B") == 5
    assert names(table)[:5] == [f"a{i}" for i in range(5, 10)]  # A's newest stayed
    assert table.num_refused == 15 and table.is_full("A") and table.is_full("B")
    table.clear()
    assert cache.num_pinned_pages() == 0


def test_the_page_bound_ends_the_pins_of_the_namespace_pinning_most():
    allocator = PageAllocator(32)
    cache = RadixCache(allocator, 1)
    prompts = {"A": [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [30, 31]], "B": [[20, 21, 22]]}
    for namespace, all_ids in prompts.items():
        for ids in all_ids:
            insert_in(cache, allocator, ids, namespace)
    table = PinTable(cache, 13, max_pins=16)
    table.pin(prefix_pin_key("b"), prompts["B"][0], namespace="B")  # the oldest pin
    for i, ids in enumerate(prompts["A"]):  # a1: 3 + 6 + 6 pages > 13, A pins the most
        table.pin(prefix_pin_key(f"a{i}"), ids, namespace="A")
    assert names(table) == ["b", "a1", "a2"]  # B's older pin stayed, A's oldest went
    assert cache.num_pinned_pages() == 11 and table.num_degraded == 1
    table.clear()
