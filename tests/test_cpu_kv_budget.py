"""The CPU KV pool's size when nobody chose it: a share of the memory available (within the
cgroup's limit), split between TP ranks and between a fleet's workers; the flags override."""

from __future__ import annotations

import logging

import pytest
import torch

from radixserve import Engine
from radixserve.cache.host_tier import create_host_tier
from radixserve.cli import main
from radixserve.config import CacheConfig, HiCacheConfig
from radixserve.config.cache import CPU_KV_MEMORY_FRACTION
from radixserve.fleet import kv_budget, launch
from radixserve.model import runner
from radixserve.model.runner import kv_budget_bytes
from radixserve.model.source import default_model_path
from radixserve.native import machine
from radixserve.native.machine import GiB, available_memory_bytes

CPU = torch.device("cpu")


def test_available_memory_is_meminfo_within_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   10485760 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory_bytes(meminfo, cgroup) == 10 * GiB
    (cgroup / "memory.max").write_text(f"{6 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{2 * GiB}\n")
    assert available_memory_bytes(meminfo, cgroup) == 4 * GiB  # the container's limit binds
    (cgroup / "memory.max").write_text("max\n")  # no limit
    assert available_memory_bytes(meminfo, cgroup) == 10 * GiB
    assert available_memory_bytes(tmp_path / "none", tmp_path / "none") is None


def test_cpu_pool_defaults_to_a_share_of_available_memory(monkeypatch, caplog):
    monkeypatch.setattr(runner, "available_memory_bytes", lambda: 10 * GiB)
    with caplog.at_level(logging.INFO, logger=runner.__name__):
        budget = kv_budget_bytes(CacheConfig(), CPU)
    assert budget == int(10 * GiB * CPU_KV_MEMORY_FRACTION)
    assert "of the 10.0 GiB available" in caplog.text
    assert kv_budget_bytes(CacheConfig(), CPU, num_ranks=2) == budget // 2
    assert kv_budget_bytes(CacheConfig(cpu_kv_cache_gb=1.5), CPU) == int(1.5 * GiB)
    assert kv_budget_bytes(CacheConfig(max_total_tokens=4096), CPU) is None
    monkeypatch.setattr(runner, "available_memory_bytes", lambda: 32 << 20)
    with pytest.raises(ValueError, match="--cpu-kv-cache-gb or --max-total-tokens"):
        kv_budget_bytes(CacheConfig(), CPU)
    with pytest.raises(ValueError, match="--cpu-kv-cache-gb must be > 0"):
        CacheConfig(cpu_kv_cache_gb=0)


def test_the_engine_sizes_its_pool_from_available_memory(tiny_chat_model, monkeypatch):
    monkeypatch.setattr(runner, "available_memory_bytes", lambda: 1 * GiB)
    engine = Engine(tiny_chat_model, page_size=16)
    try:
        pool = engine.runner.pool
        used = pool.k.numel() * pool.k.element_size() * 2
        assert 0.9 < used / (CPU_KV_MEMORY_FRACTION * GiB) < 1.01  # + a padding page or so
    finally:
        engine.shutdown()


def test_fleet_workers_share_the_default_pool_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 20 * GiB)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"\0" * 4096)
    args = kv_budget.split_cpu_kv_memory(4, {"model": str(model), "device": "cpu"})
    expected = (20 * GiB - 4 * 4096) * CPU_KV_MEMORY_FRACTION / 4 / GiB
    assert args["cpu_kv_cache_gb"] == pytest.approx(expected, abs=0.01)
    chosen = {"model": str(model), "device": "cpu", "max_total_tokens": 4096}
    assert kv_budget.split_cpu_kv_memory(4, chosen) == chosen


def test_a_fleet_of_the_default_model_shares_the_pool_memory(monkeypatch):
    """README's `radixserve fleet --workers 4` names no model: the default model's file is
    the weights each worker loads (it crashed on the missing path before any worker ran)."""
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 20 * GiB)
    monkeypatch.setattr(launch, "require_router", lambda: None)
    seen = {}

    def stop_before_starting(config, server, engine_args, keys=None):
        seen.update(engine_args)
        raise KeyboardInterrupt  # nothing is started: the workers' arguments are the point

    monkeypatch.setattr(launch, "fleet_children", stop_before_starting)
    with pytest.raises(KeyboardInterrupt):
        main(["fleet", "--workers", "4", "--router-port", "30000"])
    weights = default_model_path().stat().st_size
    expected = (20 * GiB - 4 * weights) * CPU_KV_MEMORY_FRACTION / 4 / GiB
    assert seen["model"] is None
    assert seen["cpu_kv_cache_gb"] == pytest.approx(expected, abs=0.01)


# ---- beside an in-memory host tier (--enable-hierarchical-cache) ---------------------------

HICACHE = {"enable_hierarchical_cache": True}


def test_an_in_memory_tier_by_ratio_shares_the_default_kv_memory(monkeypatch, tmp_path):
    """Before, a default CPU pool took 40% of the memory and the tier twice that on top:
    120% of what was available, found out by the OOM killer once the pool filled."""
    assert HiCacheConfig(**HICACHE).memory_tier_ratio() == 2.0
    assert HiCacheConfig(**HICACHE, hicache_ratio=0.5).memory_tier_ratio() == 0.5
    for not_in_memory_by_ratio in (
        HiCacheConfig(),
        HiCacheConfig(**HICACHE, hicache_size=1.0),
        HiCacheConfig(**HICACHE, hicache_dir=str(tmp_path)),
    ):
        assert not_in_memory_by_ratio.memory_tier_ratio() == 0.0
    monkeypatch.setattr(runner, "available_memory_bytes", lambda: 9 * GiB)
    alone = kv_budget_bytes(CacheConfig(), CPU)
    assert kv_budget_bytes(CacheConfig(), CPU, tier_ratio=2.0) == pytest.approx(alone / 3, abs=1)
    chosen = CacheConfig(cpu_kv_cache_gb=1.5)
    assert kv_budget_bytes(chosen, CPU, tier_ratio=2.0) == int(1.5 * GiB)
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 20 * GiB)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"\0" * 4096)
    args = kv_budget.split_cpu_kv_memory(2, {"model": str(model), "device": "cpu"} | HICACHE)
    expected = (20 * GiB - 2 * 4096) * CPU_KV_MEMORY_FRACTION / 2 / 3 / GiB
    assert args["cpu_kv_cache_gb"] == pytest.approx(expected, abs=0.01)


def test_the_tier_and_the_cpu_pool_fill_memory_together(tiny_chat_model, monkeypatch):
    monkeypatch.setattr(runner, "available_memory_bytes", lambda: 1 * GiB)
    engine = Engine(tiny_chat_model, page_size=16, **HICACHE)
    try:
        pool, tier = engine.runner.pool, engine.core.cache.tier
        pool_bytes = pool.k.nbytes + pool.v.nbytes
        tier_bytes = tier.num_slots * tier.layout.page_nbytes
        assert 0.9 < (pool_bytes + tier_bytes) / (CPU_KV_MEMORY_FRACTION * GiB) < 1.01
        assert tier_bytes == pytest.approx(2 * pool_bytes, rel=0.01)
        # the pool's pages are taken as it fills: a tier that fits alone is still refused
        monkeypatch.setattr(machine, "available_memory_bytes", lambda: tier_bytes + pool_bytes // 2)
        with pytest.raises(
            ValueError, match=r"host tier .* beside the KV pool's .*--hicache-ratio"
        ):
            create_host_tier(pool, HiCacheConfig(**HICACHE))
    finally:
        engine.shutdown()
