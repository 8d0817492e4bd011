"""The hierarchical cache through the engine: a prompt evicted from a tiny pool comes back
from the tier with the same greedy tokens, a restarted engine serves it from its file, and
a file of another model is never used."""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import TINY, VOCAB, ServerProcess, greedy, make_engine, prompt_ids
from radixserve.cache.hiradix_cache import INDEX_FILE

POOL = {"max_total_tokens": 640, "page_size": 16}  # 40 pages
TIER = {"enable_hierarchical_cache": True, "hicache_ratio": 4.0}
HISTORY = prompt_ids(1, 160)  # 10 pages


def _flood(engine, num: int = 12) -> None:
    for i in range(num):
        engine.generate(input_ids=prompt_ids(100 + i, 96), sampling_params=greedy(8))


def _resume(engine) -> dict:
    return engine.generate(input_ids=HISTORY + prompt_ids(7, 16), sampling_params=greedy(8))


def test_pages_evicted_to_the_tier_come_back_with_the_same_tokens(tiny_chat_model):
    with make_engine(tiny_chat_model, **POOL) as plain:
        first = _resume(plain)
        _flood(plain)
        recomputed = _resume(plain)
        assert recomputed["meta_info"]["cached_tokens"] == 0  # LRU alone lost it
    for policy in ("write_through", "write_back", "write_through_selective"):
        with make_engine(tiny_chat_model, hicache_write_policy=policy, **POOL, **TIER) as engine:
            engine.generate(input_ids=HISTORY, sampling_params=greedy(1))
            if policy == "write_through_selective":  # copied once hit twice
                engine.generate(input_ids=HISTORY + [5], sampling_params=greedy(1))
                engine.generate(input_ids=HISTORY + [6], sampling_params=greedy(1))
            _flood(engine)
            resumed = _resume(engine)
            stats = engine.get_stats()
            engine.check_integrity()
        assert resumed["output_ids"] == first["output_ids"] == recomputed["output_ids"], policy
        assert resumed["meta_info"]["cached_tokens"] == 160, policy
        assert resumed["meta_info"]["cached_tokens_details"]["host"] > 0, policy
        assert stats["cached_tokens_host"] >= 160 and stats["hicache_bytes_to_device"] > 0
        assert stats["hicache_bytes_to_host"] > 0


def test_a_pool_full_of_locked_requests_loads_what_fits_and_never_leaks(tiny_chat_model):
    with make_engine(tiny_chat_model, **POOL, **TIER) as engine:
        engine.generate(input_ids=HISTORY, sampling_params=greedy(1))
        _flood(engine)
        batch = [HISTORY + prompt_ids(50 + i, 16) for i in range(3)]
        batch += [prompt_ids(200 + i, 150) for i in range(3)]
        engine.generate(input_ids=batch, sampling_params=greedy(24))
        engine.check_integrity()
        assert engine.flush_cache()
        stats = engine.get_stats()
        assert stats["pool_free_pages"] == stats["pool_capacity_pages"]
        assert stats["hicache_used_pages"] == 0
        engine.check_integrity()


def test_a_restarted_engine_serves_the_prompt_from_its_tier_file(tiny_chat_model, tmp_path):
    flags = POOL | TIER | {"hicache_dir": str(tmp_path)}
    with make_engine(tiny_chat_model, **flags) as engine:
        first = _resume(engine)
    assert (tmp_path / INDEX_FILE).exists()
    with make_engine(tiny_chat_model, **flags) as engine:
        again = _resume(engine)
        engine.check_integrity()
    assert again["meta_info"]["cached_tokens"] == 160
    assert again["output_ids"] == first["output_ids"]


def test_a_restarted_engine_with_another_pool_size_serves_the_prompt(tiny_chat_model, tmp_path):
    """The tier's size follows the pool's, which on CPU follows the memory available at start:
    a restart whose pool (and so tier) differs in size still serves what the file holds."""
    first_flags = POOL | TIER | {"hicache_dir": str(tmp_path)}
    with make_engine(tiny_chat_model, **first_flags) as engine:
        first = _resume(engine)
    for max_total_tokens in (960, 480):  # a larger tier, then a smaller one (both hold it)
        flags = first_flags | {"max_total_tokens": max_total_tokens}
        with make_engine(tiny_chat_model, **flags) as engine:
            again = _resume(engine)
            engine.check_integrity()
        assert again["meta_info"]["cached_tokens"] == 160, max_total_tokens
        assert again["meta_info"]["cached_tokens_details"]["host"] == 160
        assert again["output_ids"] == first["output_ids"]


def test_a_tier_file_of_other_weights_is_discarded(tiny_chat_model, tmp_path, caplog):
    flags = POOL | TIER | {"hicache_dir": str(tmp_path / "tier")}
    with make_engine(tiny_chat_model, **flags) as engine:
        _resume(engine)
    other = _same_model_other_weights(tiny_chat_model, tmp_path / "other")
    with caplog.at_level(logging.WARNING), make_engine(str(other), **flags) as engine:
        resumed = engine.generate(input_ids=HISTORY + [9], sampling_params=greedy(1))
        engine.check_integrity()
    assert "another setup (differs in: model)" in caplog.text
    assert resumed["meta_info"]["cached_tokens"] == 0


def _same_model_other_weights(model: str, parent: Path) -> Path:
    """The tiny chat model's config and folder name, other random weights."""
    torch.manual_seed(5)
    config = LlamaConfig(**(TINY | {"vocab_size": VOCAB, "max_position_embeddings": 2048}))
    folder = parent / Path(model).name
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"enable_hierarchical_cache": True, "hicache_write_policy": "x"}, "--hicache-write"),
        ({"hicache_size": 1.0}, "--hicache-size needs --enable-hierarchical-cache"),
        (
            {"enable_hierarchical_cache": True, "disable_radix_cache": True},
            "drop --disable-radix-cache",
        ),
        # a tier in memory larger than the machine's: refused, not the allocator's error
        (
            {"enable_hierarchical_cache": True, "hicache_size": 1e7},
            "--hicache-size .*: the host tier",
        ),
        ({"enable_hierarchical_cache": True, "hicache_ratio": 1e8}, "--hicache-ratio .*: the host"),
    ],
)
def test_engine_flag_errors_name_the_flag(tiny_chat_model, flags, message):
    with pytest.raises(ValueError, match=message):
        make_engine(tiny_chat_model, **flags)


def _post_generate(url: str, ids: list[int]) -> dict:
    body = json.dumps({"input_ids": ids, "sampling_params": greedy(4)}).encode()
    request = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_a_restarted_server_serves_the_prompt_from_its_tier_file(tiny_chat_model, tmp_path):
    flags = ("--enable-hierarchical-cache", "--hicache-dir", str(tmp_path))
    ids = HISTORY + prompt_ids(3, 8)
    first = ServerProcess(tiny_chat_model, *flags)
    try:
        before = _post_generate(first.url, ids)
    finally:
        assert first.stop() == 0  # SIGTERM: a clean shutdown saves the tier's index
    second = ServerProcess(tiny_chat_model, *flags)
    try:
        after = _post_generate(second.url, ids)
        with urllib.request.urlopen(second.url + "/metrics", timeout=30) as reply:
            metrics = reply.read().decode()
    finally:
        second.stop()
    assert after["meta_info"]["cached_tokens"] == 160
    assert after["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 160}
    assert after["output_ids"] == before["output_ids"]
    assert "radixserve:cached_tokens_host_total 160.0" in metrics
