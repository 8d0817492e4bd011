"""KV pages as bytes and their transfer between two pools (radixserve/disagg), on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
import zlib

import pytest
import torch

from radixserve.cache.kv_pool import KVPool, PoolShape
from radixserve.disagg.kv_pages import page_nbytes, read_page, write_page
from radixserve.disagg.transfer import (
    DONE,
    FRAME,
    PAGE,
    REQUEST,
    FakeKVTransfer,
    KVTransferError,
    KVTransferTimeout,
    TcpKVTransfer,
)

SHAPE = PoolShape(num_layers=3, num_pages=12, page_size=4, num_kv_heads=2, head_dim=8)
HOST = "127.0.0.1"


def filled_pool(dtype=torch.float32, seed=0) -> KVPool:
    pool = KVPool(SHAPE, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    return pool


def page_kv(pool: KVPool, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(page * SHAPE.page_size, (page + 1) * SHAPE.page_size)
    return pool.k[:, rows].clone(), pool.v[:, rows].clone()


@pytest.fixture
def prefill():
    transfer = TcpKVTransfer(wait_timeout_s=2.0)
    port = transfer.listen(HOST, 0)
    yield transfer, port
    transfer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_between_pools_bit_exactly(dtype):
    src, dst = filled_pool(dtype, seed=1), filled_pool(dtype, seed=2)
    untouched = page_kv(dst, 4)
    for src_page, dst_page in ((3, 7), (5, 2)):
        write_page(dst, dst_page, read_page(src, src_page))
        for a, b in zip(page_kv(src, src_page), page_kv(dst, dst_page)):
            assert torch.equal(a, b)
    for a, b in zip(untouched, page_kv(dst, 4)):
        assert torch.equal(a, b)  # only the written pages changed
    with pytest.raises(ValueError, match="bytes"):
        write_page(dst, 1, b"short")


def test_tcp_ships_a_rooms_pages_whole_and_in_order(prefill):
    transfer, port = prefill
    src, dst = filled_pool(seed=3), filled_pool(seed=4)
    pages = [read_page(src, p) for p in (5, 1, 9)]
    results = {}
    fetcher = threading.Thread(
        target=lambda: results.update(got=TcpKVTransfer().fetch(HOST, port, 42, len(pages[0]), 5))
    )
    fetcher.start()  # the decode side may ask before the prefill side has the KV
    time.sleep(0.2)
    transfer.publish(42, pages)
    fetcher.join(10)
    assert results["got"] == pages and transfer.num_rooms() == 0
    for dst_page, data in zip((2, 3, 4), results["got"]):
        write_page(dst, dst_page, data)
    for src_page, dst_page in ((5, 2), (1, 3), (9, 4)):
        assert all(
            torch.equal(a, b) for a, b in zip(page_kv(src, src_page), page_kv(dst, dst_page))
        )


def test_a_room_that_never_comes_is_a_clear_error(prefill):
    transfer, port = prefill
    transfer.wait_timeout_s = 0.3
    with pytest.raises(KVTransferError, match="bootstrap_room 7 not ready"):
        TcpKVTransfer().fetch(HOST, port, 7, 64, timeout_s=5)
    with pytest.raises(KVTransferTimeout, match="bootstrap_room 8"):
        TcpKVTransfer().fetch(HOST, port, 8, 64, timeout_s=0.1)  # decode gives up first


def test_an_aborted_room_fails_its_fetch_at_once(prefill):
    transfer, port = prefill
    transfer.wait_timeout_s = 30.0
    start = time.monotonic()
    threading.Timer(0.2, transfer.publish_error, (9, "room 9 aborted")).start()
    with pytest.raises(KVTransferError, match="room 9 aborted"):
        TcpKVTransfer().fetch(HOST, port, 9, 64, timeout_s=10)
    assert time.monotonic() - start < 5 and transfer.num_rooms() == 0
    FakeKVTransfer().publish_error(9, "nothing to tell")  # the fake backend has no peer


def test_page_size_mismatch_is_refused(prefill):
    transfer, port = prefill
    transfer.publish(1, [b"x" * 32])
    with pytest.raises(KVTransferError, match="page size mismatch"):
        TcpKVTransfer().fetch(HOST, port, 1, 64, timeout_s=5)


def test_prefill_gone_is_a_clear_error():
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    with pytest.raises(KVTransferError, match=f"{HOST}:{port}"):
        TcpKVTransfer().fetch(HOST, port, 1, 64, timeout_s=2)


def serve_once(frames: bytes) -> int:
    """A fake prefill worker: reads one request, sends `frames`, hangs up."""
    listener = socket.create_server((HOST, 0))

    def answer():
        conn, _ = listener.accept()
        with conn, listener:
            conn.recv(REQUEST.size)
            conn.sendall(frames)

    threading.Thread(target=answer, daemon=True).start()
    return listener.getsockname()[1]


def test_corrupt_or_cut_transfers_are_detected():
    page = b"\x01" * 64
    corrupt = FRAME.pack(PAGE, 0, zlib.crc32(page) ^ 1, 64) + page + FRAME.pack(DONE, 0, 0, 0)
    with pytest.raises(KVTransferError, match="checksum"):
        TcpKVTransfer().fetch(HOST, serve_once(corrupt), 1, 64, timeout_s=5)
    cut = FRAME.pack(PAGE, 0, zlib.crc32(page), 64) + page[:10]  # prefill died mid-page
    with pytest.raises(KVTransferError, match="connection closed"):
        TcpKVTransfer().fetch(HOST, serve_once(cut), 1, 64, timeout_s=5)


def test_fake_backend_moves_nothing_and_succeeds():
    fake = FakeKVTransfer()
    fake.publish(3, [b"page"])
    assert fake.fetch(HOST, 1, 3, 4, timeout_s=0.1) is None


def test_page_nbytes_matches_the_bytes_read():
    for dtype in (torch.float32, torch.bfloat16):
        pool = filled_pool(dtype)
        assert len(read_page(pool, 1)) == page_nbytes(pool)
