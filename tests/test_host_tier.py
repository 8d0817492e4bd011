"""The host tier on its own: slots, checksums, the file it maps, and the flags that size it."""

from __future__ import annotations

import os

import pytest
import torch

from radixserve.cache.host_tier import HostTier, TierFullError, TierLayout
from radixserve.cache.kv_pool import KVPool, PoolShape
from radixserve.cli import build_parser, engine_args_from
from radixserve.config import FleetConfig, HiCacheConfig, ServerConfig
from radixserve.fleet.launch import worker_children

LAYOUT = TierLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def _pool(num_pages: int = 8) -> KVPool:
    shape = PoolShape(num_layers=2, num_pages=num_pages, page_size=4, num_kv_heads=2, head_dim=8)
    pool = KVPool(shape, torch.float32, "cpu")
    pool.k.normal_()
    pool.v.normal_()
    return pool


def test_pages_round_trip_through_the_tier_into_other_pool_pages():
    pool = _pool()
    tier = HostTier(LAYOUT, num_slots=4)
    slots = tier.allocate(2)
    tier.write(slots, pool.read_pages([3, 5]))
    pool.write_pages([1, 2], tier.read(slots))
    assert torch.equal(pool.read_pages([1, 2]), pool.read_pages([3, 5]))
    assert tier.bytes_written == tier.bytes_read == 2 * LAYOUT.page_nbytes
    assert tier.bad_slots(slots) == []


def test_slots_are_allocated_freed_and_never_double_freed():
    tier = HostTier(LAYOUT, num_slots=3)
    first = tier.allocate(3)
    assert sorted(first) == [0, 1, 2] and tier.num_free == 0
    with pytest.raises(TierFullError):
        tier.allocate(1)
    tier.free(first[:1])
    with pytest.raises(ValueError, match="double free"):
        tier.free(first[:1])
    assert tier.allocate(1) == first[:1]
    tier.free([0, 1, 2])
    tier.claim([2])
    assert tier.used_slots() == [2] and tier.num_free == 2


def test_a_changed_byte_fails_the_slot_checksum():
    pool = _pool()
    tier = HostTier(LAYOUT, num_slots=2)
    tier.write([0, 1], pool.read_pages([1, 2]))
    tier.data[1, 7] ^= 0xFF
    assert tier.bad_slots([0, 1]) == [1]


def test_a_tier_folder_keeps_its_bytes_and_is_one_process_s(tmp_path):
    pool = _pool()
    tier = HostTier(LAYOUT, num_slots=2, folder=str(tmp_path))
    tier.write([1], pool.read_pages([4]))
    with pytest.raises(ValueError, match="--hicache-dir .* in use"):
        HostTier(LAYOUT, num_slots=2, folder=str(tmp_path))
    tier.close()
    again = HostTier(LAYOUT, num_slots=2, folder=str(tmp_path))
    assert torch.equal(again.read([1]), pool.read_pages([4]))
    again.close()
    larger = HostTier(LAYOUT, num_slots=3, folder=str(tmp_path))  # another size: kept
    assert torch.equal(larger.read([1]), pool.read_pages([4])) and not larger.data[2].any()
    larger.close()
    smaller = HostTier(LAYOUT, num_slots=1, folder=str(tmp_path))  # the first slots kept
    assert os.path.getsize(smaller.path) == LAYOUT.page_nbytes and not smaller.data.any()
    smaller.close()


def test_tier_size_from_ratio_or_gigabytes():
    assert HiCacheConfig(hicache_ratio=2.5).num_tier_pages(10, 1000) == 25
    assert HiCacheConfig(hicache_size=0.001).num_tier_pages(10, 1000) == 1000
    with pytest.raises(ValueError, match="--hicache-ratio 0.01 holds no KV page"):
        HiCacheConfig(hicache_ratio=0.01).num_tier_pages(10, 1000)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"hicache_write_policy": "sometimes"}, "--hicache-write-policy must be one of"),
        ({"hicache_size": -1.0}, "--hicache-size must be > 0"),
        ({"hicache_ratio": 0.0}, "--hicache-ratio must be > 0"),
    ],
)
def test_bad_flags_are_named(flags, message):
    with pytest.raises(ValueError, match=message):
        HiCacheConfig(enable_hierarchical_cache=True, **flags).verify()


def test_tier_flags_without_the_tier_are_refused():
    with pytest.raises(ValueError, match="--hicache-dir needs --enable-hierarchical-cache"):
        HiCacheConfig(hicache_dir="/tmp/x").verify()


def test_an_unwritable_dir_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--hicache-dir .* cannot be created"):
        HiCacheConfig(enable_hierarchical_cache=True, hicache_dir=str(blocker / "d")).verify()


def test_serve_takes_the_flags_and_fleet_workers_get_a_folder_each(tmp_path):
    argv = ["serve", "m", "--enable-hierarchical-cache", "--hicache-write-policy", "write_back"]
    argv += ["--hicache-size", "2", "--hicache-dir", str(tmp_path)]
    engine_args = engine_args_from(build_parser().parse_args(argv))
    assert engine_args["enable_hierarchical_cache"] and engine_args["hicache_size"] == 2.0
    assert engine_args["hicache_write_policy"] == "write_back"
    workers = worker_children(FleetConfig(workers=2), ServerConfig(), engine_args)
    for i, worker in enumerate(workers):
        assert worker.command.count("--hicache-dir") == 1
        folder = worker.command[worker.command.index("--hicache-dir") + 1]
        assert folder == str(tmp_path / f"worker-{i}")
