"""KVEventPublisher: sends the radix cache's KV events over ZMQ, as vLLM's ZmqEventPublisher.

The core thread only puts events into a bounded queue (`publish` never blocks: a full queue
drops the event and counts it). A background thread owns the sockets: woken by an event, it
waits `BATCH_LINGER_S` for the rest of the step's, takes up to `MAX_BATCH_EVENTS`, and sends
them as one `KVEventBatch` in a ZMQ multipart message

    [topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]      seq = 0, 1, 2, ...

The PUB socket binds loopback by default (KVEventsConfig.pub_address; a wildcard is bound
only when asked for, with a warning: the events carry every tenant's token ids unless
`include_token_ids` is false).

With `replay_endpoint`, a ROUTER socket (always bound) answers `[identity, b"", start_seq]`
with every buffered batch from `start_seq` on, then `[identity, b"", seq -1, b""]` (vLLM's
protocol), so a subscriber that sees a gap in the seqs can fetch what it missed. Replays
are rate-limited (`max_replays_per_s`, a token bucket over all clients: identities are the
peer's choice): a request over the limit gets the end marker alone, and is counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from radixserve.cache.kv_events import KVCacheEvent, KVEventBatch
from radixserve.config import KVEventsConfig

logger = logging.getLogger(__name__)

MAX_BATCH_EVENTS = 1024  # events per batch at most: bounds a message's size
BATCH_LINGER_S = 0.005  # after the first event, wait this long for more to share its batch
POLL_S = 0.1  # how often the idle thread looks at the replay socket and the stop flag
MAX_REPLAYS_PER_POLL = 64  # replay requests read per pass: a flood cannot stall publishing
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
FLAG = "--kv-events-config"


def import_zmq() -> Any:
    """pyzmq, or a clear error naming the flag that needs it."""
    try:
        import zmq
    except ImportError as exc:
        raise RuntimeError(
            f"{FLAG} with publisher zmq needs pyzmq: pip install 'radixserve[kv-events]'"
        ) from exc
    return zmq


class KVEventPublisher:
    """Batches, numbers and sends KV events from a background thread (see module doc)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None):
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0  # events the full queue turned away
        self.num_batches = 0  # batches sent; the next batch's seq
        self.num_replays = 0  # replay requests answered in full
        self.num_replays_refused = 0  # over max_replays_per_s: answered with the end alone
        self.bound: list[str] = []  # the addresses the sockets bound (ports resolved)
        self._replay_budget = ReplayBudget(config.max_replays_per_s)
        self._zmq = import_zmq()
        self._queue: queue.Queue[KVCacheEvent] = queue.Queue(maxsize=config.max_queue_size)
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise RuntimeError(f"{FLAG}: cannot open {self._start_error}") from self._start_error

    def publish(self, event: KVCacheEvent) -> None:
        """Queues one event for the thread; drops (and counts) it when the queue is full."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.num_dropped += 1

    def close(self) -> None:
        """Sends what is queued, then stops the thread and closes the sockets."""
        self._stop.set()
        self._thread.join()

    def stats(self) -> dict[str, int]:
        return {
            "kv_event_batches": self.num_batches,
            "kv_events_dropped": self.num_dropped,
            "kv_event_replays": self.num_replays,
            "kv_event_replays_refused": self.num_replays_refused,
        }

    # ---- the thread ----

    def _run(self) -> None:
        ctx = self._zmq.Context()
        try:
            pub, replay = self._open_sockets(ctx)
        except Exception as exc:
            self._start_error = exc
            self._started.set()
            ctx.destroy(linger=0)
            return
        self._started.set()
        try:
            self._serve(pub, replay)
        except Exception:  # the core goes on; events queue up, then are dropped and counted
            logger.exception("kv events publisher stopped")
        finally:
            ctx.destroy(linger=1000)  # a second to deliver the last batches

    def _open_sockets(self, ctx: Any) -> tuple[Any, Any | None]:
        zmq = self._zmq
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        address, bind = self.config.pub_address()
        key = "bind" if self.config.bind is not None else "endpoint"
        _open_named(lambda: self._open(pub, address, bind), key, address)
        replay = None
        if self.config.replay_endpoint is not None:
            replay = ctx.socket(zmq.ROUTER)
            endpoint = self.config.replay_endpoint
            _open_named(lambda: self._open(replay, endpoint, True), "replay_endpoint", endpoint)
        return pub, replay

    def _open(self, socket: Any, address: str, bind: bool) -> None:
        if not bind:
            socket.connect(address)
            logger.info("kv events: publishing to %s (connected)", address)
            return
        socket.bind(address)
        bound = socket.getsockopt(self._zmq.LAST_ENDPOINT).decode()
        self.bound.append(bound)
        if _is_wildcard(address):
            logger.warning(
                "kv events: %s listens on every interface; whoever reaches it reads the "
                "cache's events%s",
                bound,
                " and token ids" if self.config.include_token_ids else "",
            )
        else:
            logger.info("kv events: listening on %s", bound)

    def _serve(self, pub: Any, replay: Any | None) -> None:
        while True:
            events = self._take_batch()
            if events:
                self._send(pub, events)
            if replay is not None:
                self._answer_replays(replay)
            if self._stop.is_set() and self._queue.empty():
                return

    def _take_batch(self) -> list[KVCacheEvent]:
        """Waits up to POLL_S for a first event, sleeps BATCH_LINGER_S so that the rest of
        its step piles up, then takes what is there: one wake-up per batch, not per event
        (a waiting thread woken per event costs the core thread the GIL each time)."""
        try:
            events = [self._queue.get(timeout=POLL_S)]
        except queue.Empty:
            return []
        time.sleep(BATCH_LINGER_S)
        while len(events) < MAX_BATCH_EVENTS:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return events

    def _send(self, pub: Any, events: list[KVCacheEvent]) -> None:
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        payload = self._encoder.encode(batch)
        seq = self.num_batches
        pub.send_multipart((self.config.topic.encode(), seq.to_bytes(8, "big"), payload))
        self._replay_buffer.append((seq, payload))
        self.num_batches += 1

    def _answer_replays(self, replay: Any) -> None:
        for _ in range(MAX_REPLAYS_PER_POLL):
            if not replay.poll(0):
                return
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("kv events replay: ignoring a malformed request")
                continue
            identity, _, start = frames
            if self._replay_budget.take(time.monotonic()):
                self.num_replays += 1
                self._replay(replay, identity, int.from_bytes(start, "big", signed=True))
            else:
                self.num_replays_refused += 1
            replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def _replay(self, replay: Any, identity: bytes, start_seq: int) -> None:
        for seq, payload in list(self._replay_buffer):
            if seq >= start_seq:
                replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))


class ReplayBudget:
    """A token bucket: `rate` replays a second, bursts of up to `rate`."""

    def __init__(self, rate: int):
        self.rate = rate
        self.tokens = float(rate)
        self.updated: float | None = None

    def take(self, now: float) -> bool:
        """Spends one token if there is one."""
        if self.updated is not None:
            self.tokens = min(self.rate, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def _is_wildcard(address: str) -> bool:
    """A tcp address on every interface (`*`, 0.0.0.0, ::)."""
    if not address.startswith("tcp://"):
        return False
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host in ("0.0.0.0", "::", "") or "*" in host


def _open_named(open_socket: Any, key: str, endpoint: str) -> None:
    """Opens a socket; a failure names the config key and endpoint it was for."""
    try:
        open_socket()
    except Exception as exc:
        raise RuntimeError(f"{key} {endpoint}: {exc}") from exc
