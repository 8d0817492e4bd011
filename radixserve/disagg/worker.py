"""A worker's end of prefill/decode disaggregation, over a `KVTransfer`.

    prefill worker                              decode worker
    computes the prompt (its radix cache helps) fetch(room): a thread pulls the pages
    PrefillSender.send: the prompt's whole  --> DecodeReceiver.store: free pages of its own
      pages, copied out, under the room           pool, written, given to its radix tree
    finishes after one token; its pages go      the request is then admitted as a cache
      to its own tree as usual                    hit of those pages and decodes

Only whole pages move: the decode side computes the prompt's last partial page (fewer than
page_size tokens, at least the last token) itself, as any cache hit does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.prefix_cache import PrefixCache
from radixserve.config import DisaggregationConfig
from radixserve.disagg.auth import load_secret
from radixserve.disagg.kv_pages import page_nbytes, read_page, write_page
from radixserve.disagg.transfer import (
    DEFAULT_ROOM_BUDGET_BYTES,
    FakeKVTransfer,
    FetchCancel,
    FetchRequest,
    KVTransfer,
    KVTransferError,
    TcpKVTransfer,
)

MAX_CONCURRENT_FETCHES = 16
"""Fetch threads of a decode worker: rooms pulled at once (more wait their turn)."""


def create_transfer(config: DisaggregationConfig, pool: KVPool) -> KVTransfer:
    """The configured backend; a tcp prefill worker listens on its bootstrap port. Raises
    ValueError naming the flag for an unusable secret file or port."""
    if config.disaggregation_transfer_backend == "fake":
        return FakeKVTransfer()
    path = config.disaggregation_secret_file
    transfer = TcpKVTransfer(
        wait_timeout_s=config.disaggregation_transfer_timeout,
        secret=load_secret(path) if path else None,
        room_budget_bytes=room_budget_bytes(config, pool),
    )
    if config.mode == "prefill":
        host, port = config.disaggregation_bootstrap_host, config.disaggregation_bootstrap_port
        try:
            transfer.listen(host, port)
        except OSError as exc:
            raise ValueError(
                f"--disaggregation-bootstrap-port {port}: cannot listen on {host}: {exc}"
            ) from exc
    return transfer


def room_budget_bytes(config: DisaggregationConfig, pool: KVPool) -> int:
    """--disaggregation-room-budget-mb in bytes; 0: the pool's pages' bytes, capped."""
    if config.disaggregation_room_budget_mb:
        return config.disaggregation_room_budget_mb << 20
    return min(pool.shape.num_pages * page_nbytes(pool), DEFAULT_ROOM_BUDGET_BYTES)


def page_tokens(token_ids: Sequence[int], page_size: int) -> list[Sequence[int]]:
    """The token ids of each whole page of `token_ids`."""
    num_pages = len(token_ids) // page_size
    return [token_ids[i * page_size : (i + 1) * page_size] for i in range(num_pages)]


class PrefillSender:
    """Publishes a computed prompt's whole KV pages under its bootstrap room."""

    def __init__(self, transfer: KVTransfer, pool: KVPool):
        self.transfer = transfer
        self.pool = pool

    def send(
        self, room: int, token_ids: Sequence[int], num_tokens: int, page_table: Sequence[int]
    ) -> list[bytes]:
        """Copies out the whole pages of the first `num_tokens` of `token_ids` (the prompt)
        and publishes them; returns them (for counting)."""
        tokens = page_tokens(token_ids[:num_tokens], self.pool.page_size)
        pages = [read_page(self.pool, page) for page in page_table[: len(tokens)]]
        self.transfer.publish(room, tokens, pages)
        return pages


class DecodeReceiver:
    """Pulls rooms' pages on its own threads; stores them into the pool and tree on the
    caller's (the core's) thread."""

    def __init__(self, transfer: KVTransfer, pool: KVPool, cache: PrefixCache, timeout_s: float):
        self.transfer = transfer
        self.pool = pool
        self.cache = cache
        self.timeout_s = timeout_s
        self._nbytes = page_nbytes(pool)
        self._threads = ThreadPoolExecutor(MAX_CONCURRENT_FETCHES, thread_name_prefix="kv-fetch")
        self._cancels: dict[Future, FetchCancel] = {}  # fetches not done yet
        self._lock = threading.Lock()

    def fetch(self, host: str, port: int, room: int, token_ids: Sequence[int]) -> Future:
        """Starts pulling room `room`, whose pages must hold the whole pages of `token_ids`
        (the prompt); the future's result is its pages (None: nothing moved, the fake
        backend), or it raises KVTransferError naming the room."""
        tokens = page_tokens(token_ids, self.pool.page_size)
        req = FetchRequest(host, port, room, tokens, self._nbytes)
        cancel = FetchCancel()
        future = self._threads.submit(self.transfer.fetch, req, self.timeout_s, cancel)
        with self._lock:
            self._cancels[future] = cancel
        future.add_done_callback(self._forget)
        return future

    def cancel(self, future: Future) -> None:
        """Abandons a fetch (its request was aborted): its connection closes, and the prefill
        worker drops the room (told so when the fetch had not started)."""
        with self._lock:
            cancel = self._cancels.get(future)
        if cancel is not None:
            cancel.cancel()

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._cancels.pop(future, None)

    def store(
        self, room: int, token_ids: Sequence[int], pages: list[bytes], namespace: str | None
    ) -> int:
        """Writes `pages` (the whole pages of `token_ids`) into free pages and gives them to
        the tree; the caller has made sure that len(pages) pages are free. Returns the tokens
        they hold."""
        num_pages = len(token_ids) // self.pool.page_size
        if len(pages) != num_pages:
            raise KVTransferError(
                f"bootstrap_room {room}: the prefill worker sent {len(pages)} KV pages for a "
                f"prompt of {num_pages} whole pages (another prompt under this room?)"
            )
        ids = self.pool.allocator.allocate(num_pages).tolist()
        try:
            for page, data in zip(ids, pages):
                write_page(self.pool, page, data)
        except BaseException:
            self.pool.allocator.free(ids)
            raise
        num_tokens = num_pages * self.pool.page_size
        present = self.cache.insert(token_ids[:num_tokens], ids, namespace)
        self.pool.allocator.free(ids[: present // self.pool.page_size])  # already in the tree
        return num_tokens

    def close(self) -> None:
        with self._lock:
            cancels = list(self._cancels.values())
        for cancel in cancels:
            cancel.cancel()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.transfer.close()
