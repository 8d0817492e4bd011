"""KV pages as bytes and their transfer between two pools (radixserve/disagg), on 127.0.0.1:
the wire protocol against real and lying peers, the room store's bounds, cancellation."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from radixserve.cache.kv_pool import KVPool, PoolShape
from radixserve.disagg.fetcher import FetchCancel, FetchRequest
from radixserve.disagg.kv_pages import page_nbytes, read_page, write_page
from radixserve.disagg.protocol import (
    CHALLENGE,
    CHALLENGED,
    DONE,
    FRAME,
    HELLO,
    PAGE,
    PROOF,
    Hello,
    Session,
)
from radixserve.disagg.transfer import (
    FakeKVTransfer,
    KVTransferError,
    KVTransferTimeout,
    TcpKVTransfer,
)

SHAPE = PoolShape(num_layers=3, num_pages=12, page_size=4, num_kv_heads=2, head_dim=8)
HOST = "127.0.0.1"
SECRET = b"s" * 32
TOKENS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]


def filled_pool(dtype=torch.float32, seed=0) -> KVPool:
    pool = KVPool(SHAPE, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    return pool


def page_kv(pool: KVPool, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(page * SHAPE.page_size, (page + 1) * SHAPE.page_size)
    return pool.k[:, rows].clone(), pool.v[:, rows].clone()


def ask(port: int, room: int, tokens=TOKENS, nbytes: int = 64, secret=SECRET, timeout_s=5.0):
    req = FetchRequest(HOST, port, room, tokens, nbytes)
    return TcpKVTransfer(secret=secret).fetch(req, timeout_s)


@pytest.fixture
def prefill():
    transfer = TcpKVTransfer(wait_timeout_s=2.0, secret=SECRET)
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
    assert len(read_page(src, 1)) == page_nbytes(src)


def test_tcp_ships_a_rooms_pages_whole_and_in_order(prefill):
    transfer, port = prefill
    src, dst = filled_pool(seed=3), filled_pool(seed=4)
    pages = [read_page(src, p) for p in (5, 1, 9)]
    results = {}
    fetcher = threading.Thread(
        target=lambda: results.update(got=ask(port, 42, nbytes=len(pages[0])))
    )
    fetcher.start()  # the decode side may ask before the prefill side has the KV
    time.sleep(0.2)
    transfer.publish(42, TOKENS, pages)
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
        ask(port, 7)
    with pytest.raises(KVTransferTimeout, match="bootstrap_room 8"):
        ask(port, 8, timeout_s=0.1)  # decode gives up first


def test_an_aborted_room_fails_its_fetch_at_once(prefill):
    transfer, port = prefill
    transfer.wait_timeout_s = 30.0
    start = time.monotonic()
    threading.Timer(0.2, transfer.publish_error, (9, "room 9 aborted")).start()
    with pytest.raises(KVTransferError, match="room 9 aborted"):
        ask(port, 9, timeout_s=10)
    assert time.monotonic() - start < 5 and transfer.num_rooms() == 0
    FakeKVTransfer().publish_error(9, "nothing to tell")  # the fake backend has no peer


def test_page_size_or_count_mismatch_is_refused(prefill):
    transfer, port = prefill
    transfer.publish(1, TOKENS[:1], [b"x" * 32])
    with pytest.raises(KVTransferError, match="page size mismatch"):
        ask(port, 1, tokens=TOKENS[:1])
    transfer.publish(2, TOKENS[:1], [b"x" * 64])
    with pytest.raises(KVTransferError, match="1 KV pages here, 3 expected"):
        ask(port, 2)


def test_pages_of_another_prompt_under_the_room_are_refused(prefill):
    transfer, port = prefill
    transfer.publish(3, [[1, 2, 3, 4], [5, 6, 7, 99]], [b"a" * 64, b"b" * 64])
    with pytest.raises(KVTransferError, match="KV page 1: bad MAC"):
        ask(port, 3, tokens=TOKENS[:2])


def test_prefill_gone_is_a_clear_error():
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    with pytest.raises(KVTransferError, match=f"{HOST}:{port}"):
        ask(port, 1, timeout_s=2)


# ---- the secret ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server_secret", "client_secret", "message"),
    [
        (SECRET, b"t" * 32, "could not prove the disaggregation secret"),
        (SECRET, None, "needs --disaggregation-secret-file"),
        (None, SECRET, "has no --disaggregation-secret-file"),
    ],
)
def test_a_peer_without_the_secret_gets_nothing_and_drains_nothing(
    server_secret, client_secret, message
):
    transfer = TcpKVTransfer(wait_timeout_s=2.0, secret=server_secret)
    port = transfer.listen(HOST, 0)
    try:
        transfer.publish(5, TOKENS[:1], [b"k" * 64])
        with pytest.raises(KVTransferError, match=message):
            ask(port, 5, tokens=TOKENS[:1], secret=client_secret)
        assert transfer.num_rooms() == 1  # the stranger did not take the room
        assert ask(port, 5, tokens=TOKENS[:1], secret=server_secret) == [b"k" * 64]
    finally:
        transfer.close()


def test_without_a_secret_only_loopback_peers_are_fetched_from():
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="not loopback"):
        TcpKVTransfer().fetch(FetchRequest("192.0.2.1", 8998, 1, TOKENS, 64), 5)
    assert time.monotonic() - start < 1  # refused before any connection


def lying_peer(answer) -> int:
    """A fake prefill worker holding SECRET: proves it, then `answer(conn, session)`."""
    listener = socket.create_server((HOST, 0))

    def serve():
        conn, _ = listener.accept()
        with conn, listener:
            hello = Hello.unpack(conn.recv(HELLO.size, socket.MSG_WAITALL))
            session = Session(SECRET, hello, b"n" * 32)
            conn.sendall(CHALLENGE.pack(CHALLENGED, b"n" * 32, session.mac(b"prefill")))
            conn.recv(PROOF.size, socket.MSG_WAITALL)
            answer(conn, session)
            time.sleep(0.5)

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def page_frame(session: Session, index: int, payload: bytes, nbytes: int | None = None) -> bytes:
    mac = session.page_mac(index, TOKENS[index], payload)
    return FRAME.pack(PAGE, index, len(payload) if nbytes is None else nbytes, mac)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        # a flipped byte: the MAC catches what a checksum would
        (lambda s: page_frame(s, 0, b"\x01" * 64) + b"\x02" * 64, "KV page 0: bad MAC"),
        # a frame announcing a huge payload: refused before a byte of it is read
        (lambda s: page_frame(s, 0, b"", nbytes=1 << 40), "unexpected frame"),
        # pages out of order
        (lambda s: page_frame(s, 1, b"\x01" * 64) + b"\x01" * 64, "unexpected frame"),
        # DONE before every page came, or with a forged MAC
        (lambda s: FRAME.pack(DONE, 0, 0, s.done_mac(1)), "unexpected frame"),
        # the peer died mid-page
        (lambda s: page_frame(s, 0, b"\x01" * 64) + b"\x01" * 10, "connection closed"),
    ],
)
def test_corrupt_forged_or_cut_transfers_are_detected(frames, message):
    port = lying_peer(lambda conn, session: conn.sendall(frames(session)))
    start = time.monotonic()
    with pytest.raises(KVTransferError, match=message):
        ask(port, 1, tokens=TOKENS[:1], timeout_s=5)
    assert time.monotonic() - start < 3


def test_a_forged_done_after_the_last_page_is_refused():
    def answer(conn, session):
        conn.sendall(page_frame(session, 0, b"\x01" * 64) + b"\x01" * 64)
        conn.sendall(FRAME.pack(DONE, 0, 0, b"\x00" * 32))

    with pytest.raises(KVTransferError, match="DONE frame's MAC"):
        ask(lying_peer(answer), 1, tokens=TOKENS[:1])


# ---- bounds: the connection pool, the room budget, cancellation ---------------------------


def test_a_flood_of_idle_connections_delays_a_fetch_but_never_stops_the_port():
    transfer = TcpKVTransfer(
        wait_timeout_s=2.0, secret=SECRET, max_connections=4, handshake_timeout_s=0.3
    )
    port = transfer.listen(HOST, 0)
    flood = [socket.create_connection((HOST, port)) for _ in range(12)]
    try:
        transfer.publish(6, TOKENS[:1], [b"q" * 64])
        start = time.monotonic()
        assert ask(port, 6, tokens=TOKENS[:1]) == [b"q" * 64]
        assert time.monotonic() - start < 3 and transfer.server.num_refused >= 8
        for conn in flood:  # every idle one was closed: refused at once or timed out
            conn.settimeout(2)
            assert conn.recv(16) in (b"", b"B")
        transfer.publish(7, TOKENS[:1], [b"r" * 64])
        assert ask(port, 7, tokens=TOKENS[:1]) == [b"r" * 64]  # the port still serves
    finally:
        for conn in flood:
            conn.close()
        transfer.close()


def test_rooms_stay_within_their_byte_budget():
    transfer = TcpKVTransfer(wait_timeout_s=0.5, secret=SECRET, room_budget_bytes=128)
    port = transfer.listen(HOST, 0)
    try:
        for room in (1, 2, 3):  # 64 bytes each: the oldest goes to make space for the third
            transfer.publish(room, TOKENS[:1], [bytes([room]) * 64])
        assert transfer.rooms.num_bytes() == 128
        transfer.publish(4, TOKENS[:3], [b"z" * 64] * 3)  # larger than the whole budget
        with pytest.raises(KVTransferError, match="room byte budget"):
            ask(port, 1, tokens=TOKENS[:1])
        with pytest.raises(KVTransferError, match="exceed the room budget"):
            ask(port, 4)
        assert ask(port, 3, tokens=TOKENS[:1]) == [b"\x03" * 64]
    finally:
        transfer.close()


def test_a_cancelled_fetch_has_the_prefill_side_drop_its_room(prefill):
    transfer, port = prefill
    transfer.wait_timeout_s = 10.0
    # cancelled while it waits for the room: its connection closes, the room is dropped
    cancel = FetchCancel()
    errors = []
    req = FetchRequest(HOST, port, 11, TOKENS[:1], 64)
    client = TcpKVTransfer(secret=SECRET)

    def fetch():
        try:
            client.fetch(req, 10, cancel)
        except KVTransferError as exc:
            errors.append(str(exc))

    waiter = threading.Thread(target=fetch)
    waiter.start()
    time.sleep(0.3)
    cancel.cancel()
    waiter.join(5)
    assert errors and "cancelled" in errors[0]
    time.sleep(0.3)  # the prefill side notices within its poll interval
    transfer.publish(11, TOKENS[:1], [b"d" * 64])
    assert transfer.num_rooms() == 0  # discarded on arrival
    # cancelled before it started: it tells the prefill side to drop the room
    early = FetchCancel()
    early.cancel()
    assert client.fetch(FetchRequest(HOST, port, 12, TOKENS[:1], 64), 5, early) == []
    transfer.publish(12, TOKENS[:1], [b"e" * 64])
    assert transfer.num_rooms() == 0


def test_fake_backend_moves_nothing_and_succeeds():
    fake = FakeKVTransfer()
    fake.publish(3, TOKENS[:1], [b"page"])
    assert fake.fetch(FetchRequest(HOST, 1, 3, TOKENS[:1], 4), timeout_s=0.1) is None
