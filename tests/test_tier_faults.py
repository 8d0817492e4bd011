"""The tier under faults: write errors during write-back (injected at the write call, and a
real file-size limit in a child process), a tier file allocated up front and owner-only,
and saved indexes broken in every shape and type."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import signal
import stat
import subprocess
import sys

import pytest
from test_hiradix_cache import LAYOUT, SEQ_A, SEQ_B, _cache, _computed, _load
from test_hiradix_restart import _saved, restarted_without_its_tier

from radixserve.cache.hiradix_cache import INDEX_FILE
from radixserve.cache.host_tier import TIER_FILE, HostTier
from radixserve.server.info_api import health_text
from radixserve.server.metrics import ServerMetrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_failing_tier_write_backs_off_leaks_nothing_and_recovers(monkeypatch):
    cache = _cache(pool_pages=9, tier_slots=16, policy="write_back")
    clock = cache.writes.clock = FakeClock()
    real_write = cache.tier.write

    def disk_full(slots, kv):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache.tier, "write", disk_full)
    _computed(cache, SEQ_A)
    _computed(cache, SEQ_B)
    assert cache.evict(8) == 8  # both write-backs fail: the pages are freed all the same
    cache.check_integrity()
    assert cache.allocator.num_free == cache.allocator.capacity
    assert cache.tier.num_free == cache.tier.num_slots  # the failed copy's slots came back
    stats = cache.tier_stats()
    assert stats["hicache_write_errors"] == 1  # the second copy was not even tried
    assert stats["hicache_write_backoff_s"] == 1.0
    assert "No space left" in stats["hicache_last_write_error"]
    assert "hicache" in health_text(stats) and "No space left" in health_text(stats)
    scrape = ServerMetrics().render(stats).decode()
    assert "radixserve:hicache_write_errors_total 1.0" in scrape
    assert "radixserve:hicache_write_backoff_seconds 1.0" in scrape

    monkeypatch.setattr(cache.tier, "write", real_write)
    _computed(cache, SEQ_A)
    cache.evict(4)  # still backing off: dropped, not copied
    assert cache.match_prefix(SEQ_A, max_tokens=16).host_tokens == 0
    clock.now += 1.0
    _computed(cache, SEQ_A)
    cache.evict(4)
    assert cache.match_prefix(SEQ_A, max_tokens=16).host_tokens == 16
    assert (
        cache.tier_stats()["hicache_write_backoff_s"] == 0 and health_text(cache.tier_stats()) == ""
    )
    cache.check_integrity()


# the child: a folder tier under write-back, then the file-size limit a full disk sets
FULL_DISK_CHILD = """
import json, resource, signal
import torch
import radixserve.cache.hiradix_cache as hiradix
from radixserve.cache.host_tier import HostTier, TierLayout
from radixserve.cache.kv_pool import KVPool, PoolShape
hiradix.PERSIST_INTERVAL_S = 0.0  # save the index at every tier change
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
layout = TierLayout(2, 4, 2, 8, "float32")
pool = KVPool(PoolShape(2, 9, 4, 2, 8), torch.float32, "cpu")
cache = hiradix.HiRadixCache(pool, HostTier(layout, 16, {folder!r}), "write_back", "m")
resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
for first in (1, 100, 1, 100):
    tokens = list(range(first, first + 16))
    pages = cache.allocator.allocate(4).tolist()
    cache.allocator.free(pages[: cache.insert(tokens, pages) // 4])
    cache.evict(4)
cache.check_integrity()
stats = cache.tier_stats()
cache.reset()
free = cache.allocator.num_free == cache.allocator.capacity
cache.close()
print(json.dumps({{"stats": stats, "pool_back": free}}))
"""


def test_a_full_disk_under_write_back_keeps_serving(tmp_path):
    code = FULL_DISK_CHILD.format(folder=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["pool_back"]
    stats = result["stats"]
    assert stats["hicache_write_errors"] >= 1
    assert "saving the tier index" in stats["hicache_last_write_error"]
    assert "File too large" in stats["hicache_last_write_error"]
    assert "no tier writes for" in out.stderr  # the warning, once per back-off
    assert not (tmp_path / (INDEX_FILE + ".tmp")).exists()  # a half-written index is removed


def test_the_tier_file_is_owner_only_and_allocated_up_front(tmp_path):
    cache = _cache(folder=str(tmp_path))
    _computed(cache, SEQ_A)
    cache.close()
    tier_file = os.stat(tmp_path / TIER_FILE)
    assert stat.S_IMODE(tier_file.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / INDEX_FILE).st_mode) == 0o600
    assert tier_file.st_size == 16 * LAYOUT.page_nbytes
    assert tier_file.st_blocks * 512 >= tier_file.st_size  # not sparse: no SIGBUS when full


def test_a_tier_file_the_disk_cannot_hold_is_refused_at_start(tmp_path):
    """A file-size limit below the tier file's size, for the instant of the allocation."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a kill
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, previous_limit[1]))
    try:
        with pytest.raises(ValueError, match="--hicache-dir .*cannot allocate the 65536-byte"):
            HostTier(LAYOUT, 64, str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_handler)
    HostTier(LAYOUT, 64, str(tmp_path)).close()  # the lock was released


def _index_with(tmp_path, mutate) -> None:
    path = tmp_path / INDEX_FILE
    document = json.loads(path.read_text())
    path.write_text(json.dumps(mutate(document)))


def _set(key, value):
    return lambda d: d | {key: value}


def _row(i, value):
    def mutate(d):
        d["entries"][0][i] = value
        return d

    return mutate


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: [d],
        lambda d: "index",
        lambda d: None,
        _set("identity", [1, 2]),
        _set("version", "1"),
        _set("entries", {"0": 1}),
        _set("entries", ["row"]),
        _set("entries", [[-1, None]]),
        _row(0, "x"),  # a non-integer parent crashed start-up (in a restart loop)
        _row(0, True),
        _row(0, 0.0),
        _row(1, 7),
        _row(2, "tokens"),
        _row(2, [1.5, 2, 3, 4]),
        _row(2, [None] * 4),
        _row(3, [0.0]),
        _row(3, {"a": 1}),
        _row(3, [-1, 1]),
        _row(4, ["crc", 1]),
        _row(4, [2**40, 1]),
        _row(3, [0, 0]),
    ],
)
def test_a_corrupt_index_of_any_shape_is_discarded_with_a_warning(tmp_path, caplog, mutate):
    _saved(tmp_path)
    _index_with(tmp_path, mutate)
    cache = restarted_without_its_tier(tmp_path, caplog, "discarding the saved tier")
    _computed(cache, SEQ_A)  # and the tier works on
    cache.evict(4)
    assert _load(cache, SEQ_A).num_tokens == 16


def test_a_deeply_nested_or_binary_index_is_discarded(tmp_path, caplog):
    for raw in (b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe\x00garbage"):
        caplog.clear()
        _saved(tmp_path)
        (tmp_path / INDEX_FILE).write_bytes(raw)
        with caplog.at_level(logging.WARNING):
            cache = _cache(folder=str(tmp_path))
        assert "unreadable index" in caplog.text
        assert cache.match_prefix(SEQ_A, max_tokens=16).host_tokens == 0
        cache.close()


def test_a_tier_write_error_on_close_is_logged_not_raised(tmp_path, caplog, monkeypatch):
    tier = HostTier(LAYOUT, 4, str(tmp_path))

    def failing_flush():
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(tier._mmap, "flush", failing_flush)
    with caplog.at_level(logging.WARNING):
        tier.close()
    assert "Input/output error" in caplog.text
    HostTier(LAYOUT, 4, str(tmp_path)).close()  # the lock was released
