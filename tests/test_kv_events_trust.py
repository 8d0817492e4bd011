"""KV events' trust boundary and bounds: the default socket binds loopback (never every
interface), `bind` binds what it names, `include_token_ids: false` sends hashes only,
replays are rate-limited, the queue drops rather than blocks; the config's errors and the
fleet's per-worker sockets."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import zmq
from listening_sockets import listening_addresses
from radix_cache_ops import insert_fresh
from test_kv_events import DECODER, tree_prefixes

from conftest import greedy, make_engine, prompt_ids
from radixserve.cache.kv_events import AllBlocksCleared, BlockStored, KVEventSink, chain_hashes
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import (
    CacheConfig,
    FleetConfig,
    KVEventsConfig,
    offset_endpoint,
    split_engine_kwargs,
)
from radixserve.engine.core import EngineCore
from radixserve.engine.kv_publisher import END_OF_REPLAY, KVEventPublisher, ReplayBudget
from radixserve.fleet.launch import worker_engine_args
from radixserve_bench.systems import _port_free

DEFAULT_PORT = 5557


def _receive_one(ctx, address: str, publisher: KVEventPublisher, timeout_s: float = 10):
    """Connects a SUB socket to `address` and publishes until a batch arrives (a PUB drops
    what it sends before the subscription reaches it)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        publisher.publish(BlockStored([7], None, [1, 2], 2, None, "CPU"))
        if sub.poll(100):
            return DECODER.decode(sub.recv_multipart()[2])
    raise AssertionError(f"nothing arrived from {address}")


def test_the_default_binds_loopback_only_and_serves_a_local_subscriber():
    config = KVEventsConfig(enable_kv_cache_events=True)
    assert config.pub_address() == (f"tcp://127.0.0.1:{DEFAULT_PORT}", True)
    index = next(i for i in range(64) if _port_free(DEFAULT_PORT + i))
    port = DEFAULT_PORT + index
    publisher = KVEventPublisher(config.for_instance(index))  # a fleet worker's default
    ctx = zmq.Context()
    try:
        assert publisher.bound == [f"tcp://127.0.0.1:{port}"]
        on_port = {a for a, p in listening_addresses(os.getpid()) if p == port}
        assert on_port == {"127.0.0.1"}
        assert _receive_one(ctx, f"tcp://127.0.0.1:{port}", publisher).events
    finally:
        publisher.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"endpoint": "tcp://127.0.0.1:1", "bind": "tcp://127.0.0.1:2"}, "not both"),
        ({"bind": "127.0.0.1:5557"}, "bind must be a ZMQ address"),
        ({"bind": 5557}, "bind must be a ZMQ address"),
        ({"replay_endpoint": "http://x"}, "replay_endpoint must be a ZMQ address"),
        ({"include_token_ids": "no"}, "include_token_ids must be true or false"),
        ({"max_replays_per_s": 0}, "max_replays_per_s must be an int >= 1"),
    ],
)
def test_bad_socket_keys_name_the_flag_and_key(config, message):
    text = json.dumps({"enable_kv_cache_events": True, **config})
    with pytest.raises(ValueError, match=message) as info:
        CacheConfig(kv_events_config=text).kv_events()
    assert "--kv-events-config" in str(info.value)


def test_bind_is_bound_as_given_and_fleet_instances_move_the_default():
    config = KVEventsConfig(enable_kv_cache_events=True, bind="tcp://127.0.0.1:6001")
    assert config.pub_address() == ("tcp://127.0.0.1:6001", True)
    assert config.for_instance(2).pub_address() == ("tcp://127.0.0.1:6003", True)
    second = KVEventsConfig(enable_kv_cache_events=True).for_instance(2)
    assert second.pub_address() == ("tcp://127.0.0.1:5559", True)
    assert KVEventsConfig.from_json(second.to_json()) == second
    connect = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://10.0.0.1:5557")
    assert connect.pub_address() == ("tcp://10.0.0.1:5557", False)  # vLLM's rule


def test_without_token_ids_stored_pages_carry_their_hashes_only():
    events: list = []
    allocator = PageAllocator(9)
    cache = RadixCache(allocator, 2, KVEventSink(2, "CPU", events.append, False))
    insert_fresh(cache, allocator, [1, 2, 3, 4, 5])
    assert events == [BlockStored(chain_hashes(None, [1, 2, 3, 4], 2), None, [], 2, None, "CPU")]


def test_the_replay_budget_refills_at_its_rate():
    budget = ReplayBudget(2)
    assert [budget.take(0.0) for _ in range(3)] == [True, True, False]
    assert budget.take(0.25) is False  # half a token
    assert budget.take(0.5) is True
    assert [budget.take(100.0) for _ in range(3)] == [True, True, False]  # bursts of `rate`


def _replays(ctx, address: str, num: int) -> list[int]:
    """Sends `num` replay requests from 0 at once; the batches each answer carried."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    for _ in range(num):
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    counts, current = [], 0
    while len(counts) < num:
        assert dealer.poll(10_000), "no replay answer"
        _, seq, _ = dealer.recv_multipart()
        if seq == END_OF_REPLAY:
            counts.append(current)
            current = 0
        else:
            current += 1
    dealer.close(linger=0)
    return counts


def test_engine_events_without_token_ids_and_a_rate_limited_replay(tiny_chat_model):
    config = {
        "enable_kv_cache_events": True,
        "bind": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "include_token_ids": False,
        "max_replays_per_s": 2,
    }
    engine = make_engine(
        tiny_chat_model, max_total_tokens=16 * 16, kv_events_config=json.dumps(config)
    )
    ctx = zmq.Context()
    try:
        publisher = engine.core.kv_publisher
        _, replay_address = publisher.bound
        mine = listening_addresses(os.getpid())
        for address in publisher.bound:
            port = int(address.rpartition(":")[2])
            assert {a for a, p in mine if p == port} == {"127.0.0.1"}
        for i in range(2):
            engine.generate(input_ids=prompt_ids(i, 40), sampling_params=greedy(2))
        deadline = time.monotonic() + 10
        while publisher.num_batches == 0 or not publisher._queue.empty():
            assert time.monotonic() < deadline, "the publisher sent nothing"
            time.sleep(0.05)
        time.sleep(0.1)  # the batch being sent now lands in the replay buffer
        start = time.monotonic()
        counts = _replays(ctx, replay_address, 10)
        elapsed = time.monotonic() - start
        full = [c for c in counts if c]
        assert 1 <= len(full) <= 2 + 2 * elapsed  # the burst, plus what refilled meanwhile
        stats = engine.get_stats()
        assert stats["kv_event_replays"] == len(full)
        assert stats["kv_event_replays_refused"] == 10 - len(full)
        stored = [e for e in _events(ctx, replay_address, full[0]) if isinstance(e, BlockStored)]
        assert stored and all(e.token_ids == [] for e in stored)
        hashes = {h for e in stored for h in e.block_hashes}
        assert hashes == set(tree_prefixes(engine.cache))
    finally:
        ctx.destroy(linger=0)
        engine.shutdown()


def _events(ctx, address: str, expected_batches: int) -> list:
    """Every buffered event, by a replay from 0 (after the budget refilled)."""
    deadline = time.monotonic() + 10
    while True:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(address)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        batches = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            batches.append(DECODER.decode(payload))
        dealer.close(linger=0)
        if len(batches) == expected_batches or time.monotonic() > deadline:
            return [e for b in batches for e in b.events]
        time.sleep(0.5)  # refused: wait for a token


# ---- config, bounds, fleet offsets ----


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ('["zmq"]', "JSON object"),
        ('{"enable_kv_cache_events": true, "endpoit": "x"}', r"unknown keys \['endpoit'\]"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be"),
        ('{"enable_kv_cache_events": true, "max_queue_size": 0}', "max_queue_size"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ],
)
def test_bad_kv_events_config_names_the_flag(text, message):
    with pytest.raises(ValueError, match=message) as info:
        CacheConfig(kv_events_config=text).kv_events()
    assert "--kv-events-config" in str(info.value)


def test_kv_events_are_off_unless_enabled():
    assert CacheConfig().kv_events() is None
    assert CacheConfig(kv_events_config='{"publisher": "zmq"}').kv_events() is None
    config = CacheConfig(kv_events_config='{"enable_kv_cache_events": true}').kv_events()
    assert config == KVEventsConfig(enable_kv_cache_events=True)  # vLLM's defaults


def test_missing_pyzmq_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq raises ImportError
    with pytest.raises(RuntimeError, match=r"--kv-events-config .*pyzmq"):
        KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True))
    config = '{"enable_kv_cache_events": true}'
    with pytest.raises(RuntimeError, match="pyzmq"):  # before it looks for the model
        EngineCore.build(*split_engine_kwargs("/no/such/model", {"kv_events_config": config}))


def test_a_full_queue_drops_and_counts_instead_of_blocking():
    config = KVEventsConfig(enable_kv_cache_events=True, bind="tcp://127.0.0.1:*", max_queue_size=2)
    publisher = KVEventPublisher(config)
    publisher.close()  # nothing takes from the queue any more
    for _ in range(5):
        publisher.publish(AllBlocksCleared())
    assert publisher.num_dropped == 3
    assert publisher.stats()["kv_events_dropped"] == 3


def test_engine_without_kv_events_opens_no_socket(tiny_chat_model):
    engine = make_engine(tiny_chat_model, max_total_tokens=16 * 16)
    try:
        engine.generate(input_ids=prompt_ids(1, 40), sampling_params=greedy(2))
        assert engine.core.kv_publisher is None
        assert "kv_events_dropped" not in engine.get_stats()
        assert all(
            n.block_hashes is None for r in engine.cache.roots() for n in r.children.values()
        )
    finally:
        engine.shutdown()


def test_fleet_workers_get_their_own_event_sockets():
    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
    config += '"replay_endpoint": "ipc:///tmp/kv-replay"}'
    args = {"page_size": 16, "kv_events_config": config}
    assert (
        worker_engine_args(args, 0, FleetConfig())["kv_events_config"]
        == KVEventsConfig.from_json(config).to_json()
    )
    second_args = worker_engine_args(args, 2, FleetConfig())
    second = KVEventsConfig.from_json(second_args["kv_events_config"])
    assert second.endpoint == "tcp://*:5559"
    assert second.replay_endpoint == "ipc:///tmp/kv-replay_2"
    assert worker_engine_args({"page_size": 16}, 1, FleetConfig()) == {"page_size": 16}
    with pytest.raises(ValueError, match="--kv-events-config endpoint"):
        offset_endpoint("tcp://collector", 1)
