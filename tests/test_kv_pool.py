from __future__ import annotations

import pytest
import torch

from radixserve.cache.kv_pool import RESERVED_PAGES, KVPool, OutOfPagesError, PageAllocator
from radixserve.config import CacheConfig, ModelConfig
from radixserve.model.source import builtin_config


def test_pages_are_never_double_allocated():
    alloc = PageAllocator(65)
    first = alloc.allocate(10)
    second = alloc.allocate(54)
    everything = torch.cat([first, second])
    assert everything.unique().numel() == 64
    assert int(everything.min()) >= RESERVED_PAGES
    alloc.free(first[:5])
    again = alloc.allocate(5)
    assert set(again.tolist()) == set(first[:5].tolist())
    assert not set(again.tolist()) & set(second.tolist())


def test_free_count_restored_after_free():
    alloc = PageAllocator(33)
    assert alloc.num_free == 32
    pages = [alloc.allocate(n) for n in (3, 7, 1)]
    assert alloc.num_free == 21
    for p in pages:
        alloc.free(p)
    assert alloc.num_free == 32
    assert sorted(alloc.free_pages().tolist()) == list(range(1, 33))


def test_allocating_beyond_capacity_raises_clear_error():
    alloc = PageAllocator(9)
    alloc.allocate(6)
    assert not alloc.can_allocate(3)
    with pytest.raises(OutOfPagesError, match="asked for 3 KV pages but only 2 of 8 are free"):
        alloc.allocate(3)
    assert alloc.num_free == 2  # a failed allocation takes nothing


def test_double_and_foreign_free_rejected():
    alloc = PageAllocator(9)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages)
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([0])
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([9])
    assert alloc.num_free == 8


def _smollm_config() -> ModelConfig:
    return ModelConfig.from_hf_dict(builtin_config("smollm2-135m"))


@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_sized_from_tokens(page_size):
    pool = KVPool.for_model(
        _smollm_config(),
        CacheConfig(page_size=page_size, max_total_tokens=256),
        torch.float32,
        "cpu",
    )
    assert pool.capacity_tokens == 256
    assert pool.k.shape == (30, (256 // page_size + RESERVED_PAGES) * page_size, 3, 64)
    table = pool.extend_page_table([], 17)
    assert len(table) == -(-17 // page_size)
    assert pool.extend_page_table(table, 17) == table
    assert len(pool.extend_page_table(table, 33)) == -(-33 // page_size)


def test_pool_sized_from_memory_budget():
    config = _smollm_config()
    per_token = config.kv_bytes_per_token(torch.float32)
    assert per_token == 2 * 30 * 3 * 64 * 4
    pool = KVPool.for_model(
        config, CacheConfig(page_size=16), torch.float32, "cpu", 1000 * per_token
    )
    assert pool.capacity_tokens == 992  # whole pages only


def test_pool_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="holds no page"):
        KVPool.for_model(_smollm_config(), CacheConfig(max_total_tokens=8), torch.float32, "cpu")


def test_pages_are_zeroed_on_first_use_only():
    """Attention that reads whole pages (masked tail included) must never meet garbage: a
    page's K/V are zeroed the first time it is handed out, never again (no per-use memset)."""
    pool = KVPool.for_model(
        _smollm_config(), CacheConfig(max_total_tokens=64, page_size=16), torch.float32, "cpu"
    )
    for buf in (pool.k, pool.v):
        buf[:, RESERVED_PAGES * 16 :] = float("nan")  # what uninitialized memory may hold

    def page_kv(page: int) -> torch.Tensor:
        return torch.stack(
            [pool.k[:, page * 16 : (page + 1) * 16], pool.v[:, page * 16 : (page + 1) * 16]]
        )

    first = pool.allocator.allocate(2).tolist()
    assert all(bool((page_kv(p) == 0).all()) for p in first)
    untouched = [p for p in range(RESERVED_PAGES, pool.allocator.num_pages) if p not in first]
    assert all(bool(page_kv(p).isnan().all()) for p in untouched)
    pool.k[:, first[0] * 16] = 5.0  # a request wrote into it
    pool.allocator.free([first[0]])
    again = pool.allocator.allocate(1).tolist()
    assert again == [first[0]] and bool((pool.k[:, first[0] * 16] == 5.0).all())
    rest = pool.allocator.allocate(pool.allocator.num_free).tolist()
    assert all(bool((page_kv(p) == 0).all()) for p in rest)


def test_layer_kv_views_are_made_once_and_alias_the_pool():
    """An eager forward asks for a layer's K/V twice a layer: the views are made at start-up
    (the same objects every call), and writes through them land in the pool's tensors."""
    pool = KVPool.for_model(
        _smollm_config(), CacheConfig(max_total_tokens=64, page_size=16), torch.float32, "cpu"
    )
    k, v = pool.layer_kv(2)
    assert pool.layer_kv(2)[0] is k and pool.layer_kv(2)[1] is v
    k[17].fill_(3.0)
    v[17].fill_(4.0)
    assert bool((pool.k[2, 17] == 3.0).all()) and bool((pool.v[2, 17] == 4.0).all())
    assert not bool((pool.k[1, 17] == 3.0).any())
