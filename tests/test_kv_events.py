"""KV events (--kv-events-config): chained page hashes, the radix cache's hooks, the ZMQ
publisher's wire format (vLLM's), and an engine whose events replay into its own tree."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant
from listening_sockets import is_loopback, listening_addresses, process_tree
from native_http import get, post
from radix_cache_ops import insert_fresh
from test_radix_cache_state_machine import CacheMachine

from conftest import ServerProcess, free_port, greedy, make_engine, prompt_ids
from radixserve.cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSink,
    block_hash,
    chain_hashes,
)
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import KVEventsConfig
from radixserve.engine.kv_publisher import END_OF_REPLAY, KVEventPublisher

DECODER = msgspec.msgpack.Decoder(KVEventBatch)
QUIET_S = 0.5  # no message for this long: the publisher has sent everything


# ---- helpers: replay events, read the tree ----


def replay(events) -> dict[int, tuple[int, ...]]:
    """Rebuilds {block hash: page-aligned token prefix} from events, as a router would;
    raises KeyError on a parent or removal the events never stored."""
    prefixes: dict[int, tuple[int, ...]] = {}
    for event in events:
        if isinstance(event, BlockStored):
            prefix = () if event.parent_block_hash is None else prefixes[event.parent_block_hash]
            size = event.block_size
            for i, h in enumerate(event.block_hashes):
                prefix = prefix + tuple(event.token_ids[i * size : (i + 1) * size])
                prefixes[h] = prefix
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                del prefixes[h]
        else:
            assert isinstance(event, AllBlocksCleared)
            prefixes.clear()
    return prefixes


def tree_prefixes(cache: RadixCache) -> dict[int, tuple[int, ...]]:
    """{hash: prefix} of every page the tree holds, hashed here from the tokens alone."""
    out: dict[int, tuple[int, ...]] = {}
    for root in cache.roots():
        stack = [(child, ()) for child in root.children.values()]
        while stack:
            node, above = stack.pop()
            path = above + node.key
            hashes = chain_hashes(None, path, cache.page_size, root.namespace)
            assert node.block_hashes == hashes[len(above) // cache.page_size :]
            for i, h in enumerate(hashes):
                out[h] = path[: (i + 1) * cache.page_size]
            stack += [(child, path) for child in node.children.values()]
    return out


def recording_cache(page_size: int = 2, num_pages: int = 33):
    events: list = []
    allocator = PageAllocator(num_pages)
    cache = RadixCache(allocator, page_size, KVEventSink(page_size, "CPU", events.append))
    return allocator, cache, events


# ---- hashes ----


def test_hashes_chain_page_by_page_and_depend_on_parent_and_namespace():
    tokens = [5, 6, 7, 8, 9]
    h1 = block_hash(None, [5, 6])
    h2 = block_hash(h1, [7, 8])
    assert chain_hashes(None, tokens, 2) == [h1, h2]  # the partial page has no hash
    assert chain_hashes(h1, [7, 8], 2) == [h2]
    assert block_hash(h2, [5, 6]) != h1  # the parent is part of the hash
    assert block_hash(None, [5, 6], "salt") != h1  # a namespace changes the chain's start
    assert block_hash(h1, [7, 8]) != block_hash(h1, [8, 7])
    assert all(0 <= h < 2**64 for h in (h1, h2))


def test_hashes_are_the_same_in_another_process_with_another_hash_seed():
    code = "from radixserve.cache.kv_events import chain_hashes as c\n"
    code += "print(c(None, [1, 2, 3, 4], 2, 'ns'))"
    env = os.environ | {"PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == chain_hashes(None, [1, 2, 3, 4], 2, "ns")


# ---- the radix cache's hooks ----


def test_cache_reports_stored_pages_with_their_parent_and_replays_into_the_tree():
    allocator, cache, events = recording_cache()
    insert_fresh(cache, allocator, [1, 2, 3, 4, 5])  # 2 whole pages, the partial one is not
    assert events == [
        BlockStored(chain_hashes(None, [1, 2, 3, 4], 2), None, [1, 2, 3, 4], 2, None, "CPU")
    ]
    cache.match_prefix([1, 2, 9, 9, 9])  # splits (1 2 | 3 4): no event, same hashes
    insert_fresh(cache, allocator, [1, 2, 7, 8])
    insert_fresh(cache, allocator, [3, 4], namespace="user-a")
    branch = events[-2]
    assert branch.parent_block_hash == events[0].block_hashes[0]
    assert branch.token_ids == [7, 8]
    assert replay(events) == tree_prefixes(cache)
    assert len(tree_prefixes(cache)) == 4


def test_evicted_pages_are_removed_and_reset_clears_everything():
    allocator, cache, events = recording_cache()
    for i in range(4):
        insert_fresh(cache, allocator, [i, i, 9, 9, 8, 8])
    assert cache.evict(4) == 6  # whole leaves: 2 nodes of 3 pages
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 2 and all(len(e.block_hashes) == 3 for e in removed)
    assert all(e.medium == "CPU" for e in removed)
    assert replay(events) == tree_prefixes(cache)
    assert len(replay(events)) == 6
    cache.reset()
    assert events[-1] == AllBlocksCleared()
    assert replay(events) == {} == tree_prefixes(cache)


class EventsCacheMachine(CacheMachine):
    """test_radix_cache_state_machine's random request lifecycles (matches that split nodes,
    inserts, locks, pins, evictions, namespaces) with a sink: the events replay into the tree."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        super().setup(page_size)
        self.events: list = []
        sink = KVEventSink(page_size, "CPU", self.events.append)
        self.cache = RadixCache(self.allocator, page_size, sink)

    @invariant()
    def events_replay_into_the_tree(self):
        if hasattr(self, "cache"):
            assert replay(self.events) == tree_prefixes(self.cache)

    def teardown(self):
        if hasattr(self, "cache"):
            super().teardown()
            assert self.events[-1] == AllBlocksCleared() and replay(self.events) == {}


EventsCacheMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=40, deadline=None
)
test_events_state_machine = EventsCacheMachine.TestCase


def test_without_a_sink_nodes_carry_no_hashes():
    allocator = PageAllocator(9)
    cache = RadixCache(allocator, 2)
    insert_fresh(cache, allocator, [1, 2, 3, 4])
    (node,) = cache.roots()[0].children.values()
    assert node.block_hashes is None


# ---- the publisher ----


class Subscriber:
    """A SUB socket bound on loopback (the publisher connects to it, vLLM's rule for a
    non-wildcard endpoint), plus the replay client."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.batches: dict[int, KVEventBatch] = {}
        self.topics: set[bytes] = set()

    def wait_connected(self, timeout_s: float = 10) -> None:
        assert self.monitor.poll(int(timeout_s * 1000)), "the publisher never connected"
        # libzmq attaches the new connection and sends it our subscription on this socket's
        # own thread, in a call on it: poll once. A PUB drops what it sends before then.
        self.sub.poll(200)

    def receive_all(self, replay_endpoint: str) -> list[int]:
        """Live batches until quiet, then the ones missed before them from the replay socket
        (what vLLM's example subscriber does on a gap); returns the live seqs."""
        live = self.receive_until_quiet()
        expected = range(max(self.batches, default=-1) + 1)
        missing = [seq for seq in expected if seq not in self.batches]
        if missing:
            self.request_replay(replay_endpoint, missing[0])
        return live

    def receive_until_quiet(self) -> list[int]:
        """Every batch until none comes for QUIET_S; returns their seqs in arrival order."""
        seqs = []
        while self.sub.poll(int(QUIET_S * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            self.topics.add(topic)
            self.batches[seqs[-1]] = DECODER.decode(payload)
        return seqs

    def request_replay(self, endpoint: str, start_seq: int) -> list[int]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        seqs = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            seqs.append(int.from_bytes(seq, "big"))
            self.batches[seqs[-1]] = DECODER.decode(payload)
        dealer.close(linger=0)
        return seqs

    def events(self) -> list:
        return [e for seq in sorted(self.batches) for e in self.batches[seq].events]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def subscriber():
    sub = Subscriber()
    yield sub
    sub.close()


def test_publisher_sends_numbered_batches_in_vllm_format_and_replays(subscriber):
    taken = subscriber.ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    replay_endpoint = f"tcp://127.0.0.1:{port}"
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=subscriber.endpoint,
        replay_endpoint=replay_endpoint,
        topic="kv",
    )
    with pytest.raises(RuntimeError, match="cannot open"):  # the port is taken
        KVEventPublisher(config)
    taken.close(linger=0)
    publisher = _open_when_released(config)
    try:
        subscriber.wait_connected()
        publisher.publish(BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "CPU"))
        publisher.publish(BlockRemoved([2], "CPU"))
        assert subscriber.receive_until_quiet() == [0]  # both events in one batch
        publisher.publish(AllBlocksCleared())
        assert subscriber.receive_until_quiet() == [1]
        assert subscriber.topics == {b"kv"}
        first = subscriber.batches[0]
        assert first.events == [
            BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "CPU"),
            BlockRemoved([2], "CPU"),
        ]
        raw = msgspec.msgpack.encode(first)  # vLLM's array-like tagged layout
        assert msgspec.msgpack.decode(raw)[1][1] == ["BlockRemoved", [2], "CPU"]
        subscriber.batches.clear()
        assert subscriber.request_replay(replay_endpoint, 1) == [1]
        assert subscriber.request_replay(replay_endpoint, 0) == [0, 1]
        assert subscriber.events()[-1] == AllBlocksCleared()
    finally:
        publisher.close()


def _open_when_released(config: KVEventsConfig, timeout_s: float = 5.0) -> KVEventPublisher:
    """A publisher on endpoints a just-closed socket held: ZMQ releases them asynchronously."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return KVEventPublisher(config)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ---- an engine with events on ----


def test_engine_events_replay_into_its_tree_through_eviction_and_flush(tiny_chat_model, subscriber):
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": subscriber.endpoint,
        "replay_endpoint": replay_endpoint,
    }
    # 24 pages of 16 tokens: the fourth 100-token prompt evicts the first's pages
    engine = make_engine(
        tiny_chat_model, max_total_tokens=24 * 16, kv_events_config=json.dumps(config)
    )
    try:
        subscriber.wait_connected()
        for i in range(4):
            engine.generate(input_ids=prompt_ids(i, 100), sampling_params=greedy(8))
        seqs = subscriber.receive_all(replay_endpoint)
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) > 0
        assert sorted(subscriber.batches) == list(range(len(subscriber.batches)))
        events = subscriber.events()
        assert any(isinstance(e, BlockRemoved) for e in events), "nothing was evicted"
        assert {e.medium for e in events if not isinstance(e, AllBlocksCleared)} == {"CPU"}
        cached = replay(events)
        assert cached == tree_prefixes(engine.cache)
        summary = engine.tree_summary()
        assert summary["num_tokens"] == 16 * len(cached)
        assert not any(prompt_ids(0, 100)[:16] == list(p) for p in cached.values())

        next_seq = len(subscriber.batches)
        assert engine.flush_cache()
        assert subscriber.receive_until_quiet() == [next_seq]
        assert subscriber.events()[-1] == AllBlocksCleared()
        assert replay(subscriber.events()) == {} == tree_prefixes(engine.cache)
        stats = engine.get_stats()
        assert stats["kv_events_dropped"] == 0
        assert stats["kv_event_batches"] == len(subscriber.batches)
    finally:
        engine.shutdown()


# ---- a server with events on ----


def test_server_events_replay_into_cache_tree_and_flush_clears(tiny_chat_model, subscriber):
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "endpoint": subscriber.endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": "w0",
    }
    server = ServerProcess(tiny_chat_model, "--kv-events-config", json.dumps(config))
    try:
        subscriber.wait_connected()
        pids = process_tree(server.proc.pid)
        listening = {a for pid in pids for a in listening_addresses(pid)}
        assert len(pids) >= 2 and all(is_loopback(ip) for ip, _ in listening), listening

        async def go():
            for i in range(3):
                body = {"input_ids": prompt_ids(i, 50), "sampling_params": greedy(4)}
                assert (await post(server.url + "/generate", body))[0] == 200
            live = subscriber.receive_all(replay_endpoint)
            assert live == sorted(live) and len(live) > 0 and subscriber.topics == {b"w0"}
            seqs = sorted(subscriber.batches)
            assert seqs == list(range(len(seqs)))
            status, tree = await get(server.url + "/cache/tree")
            cached = replay(subscriber.events())
            assert status == 200 and tree["num_tokens"] == 16 * len(cached) > 0
            first_pages = {p[:16] for p in cached.values()}
            assert {tuple(s["first_token_ids"]) for s in tree["largest_subtrees"]} == {
                p[:8] for p in first_pages
            }
            assert (await post(server.url + "/flush_cache", {}))[0] == 200
            assert subscriber.receive_until_quiet() == [len(seqs)]
            assert subscriber.events()[-1] == AllBlocksCleared()

        asyncio.run(go())
    finally:
        assert server.stop() == 0
