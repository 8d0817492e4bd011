"""Tensor parallelism on CPU (gloo, two ranks): the same tokens as one process, logits within
reduction-order tolerance, cache hits and retractions intact, and a dead rank ends the engine.

Each TP runner or engine spawns a second process; they are kept few (two shared cores)."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch
from listening_sockets import is_loopback, listening_addresses

from conftest import (
    SYSTEM,
    greedy,
    greedy_generate,
    make_engine,
    make_runner,
    prompt_ids,
    save_tiny_model,
)
from radixserve.client.client import EngineDeadError
from radixserve.config import CacheConfig, LoadConfig, ParallelConfig, SchedulerConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.tp_runner import TPModelRunner

PROMPTS = [[(i * 37 + j * 11) % 250 + 3 for j in range(n)] for i, n in enumerate((19, 5, 33))]
KILL_DEADLINE_S = 30.0


def tp_runner(folder, tp_size: int = 2) -> TPModelRunner:
    return TPModelRunner.create(
        LoadConfig(model=str(folder), device="cpu"),
        CacheConfig(page_size=16, max_total_tokens=1024),
        ParallelConfig(tp_size=tp_size),
    )


def prefill_logits(runner, prompts) -> torch.Tensor:
    pool = runner.pool
    tables = [pool.extend_page_table([], len(p)) for p in prompts]
    try:
        batch = ForwardBatch.build(prompts, [0] * len(prompts), tables, pool.page_size)
        batch.return_all_logits = True
        return runner.forward(batch).all
    finally:
        for table in tables:
            pool.allocator.free(table)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),  # llama3 RoPE, 4 heads / 2 KV heads: one KV head per rank
        ("mistral", {}),  # sliding window
        ("qwen2", {"num_key_value_heads": 1}),  # qkv bias; 1 KV head replicated on both ranks
        ("qwen3", {}),  # q/k norm, tied embeddings (vocab-parallel head = embedding)
        ("gemma3", {}),  # hybrid sliding/global layers, Gemma's norms and scales
    ],
)
def test_tp2_matches_one_process(arch, overrides, tmp_path, monkeypatch):
    import conftest

    base = conftest.TINY_CONFIGS[arch]
    monkeypatch.setitem(conftest.TINY_CONFIGS, arch, lambda: _with(base(), overrides))
    folder = save_tiny_model(arch, tmp_path / arch)
    one = make_runner(folder, max_total_tokens=1024)
    expected_tokens = greedy_generate(one, PROMPTS, 8)
    expected_logits = prefill_logits(one, PROMPTS)
    runner = tp_runner(folder)
    try:
        assert runner.pool.shape.num_kv_heads == max(1, one.pool.shape.num_kv_heads // 2)
        logits = prefill_logits(runner, PROMPTS)
        assert greedy_generate(runner, PROMPTS, 8) == expected_tokens
    finally:
        runner.close()
    assert logits.shape == expected_logits.shape
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert not any(w.process.is_alive() for w in runner.workers)


def _with(config, overrides):
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_tp_size_that_does_not_divide_the_heads_is_refused(tiny_models):
    with pytest.raises(ValueError, match="--tp-size 3 does not divide.*num_attention_heads=4"):
        tp_runner(tiny_models["llama"], tp_size=3)


def test_fp8_with_tp_on_cpu_is_refused_before_any_rank_starts(tiny_models):
    """fp8 is sharded under --tp-size (test_tp_quantized.py) but needs CUDA: refused at once."""
    from radixserve.model.quant.quantize import QuantizationError

    config = LoadConfig(model=str(tiny_models["llama"]), device="cpu", quantization="fp8")
    with pytest.raises(QuantizationError, match="--quantization fp8 needs a CUDA GPU"):
        TPModelRunner.create(config, CacheConfig(), ParallelConfig(tp_size=2))


def test_draft_model_speculation_with_tp_is_refused_naming_both_flags(tiny_models):
    from radixserve.engine.core import EngineCore

    load = LoadConfig(model=str(tiny_models["llama"]), device="cpu")
    scheduler = SchedulerConfig(speculative_algorithm="SELF", speculative_self_layers=1)
    with pytest.raises(ValueError, match="--speculative-algorithm SELF.*--tp-size 2"):
        EngineCore.build(load, CacheConfig(), scheduler, ParallelConfig(tp_size=2))


@pytest.fixture(scope="module")
def tp_engine(tiny_chat_model):
    before = listening_addresses(os.getpid())
    engine = make_engine(
        tiny_chat_model, tp_size=2, max_total_tokens=640, chunked_prefill_size=64, device="cpu"
    )
    engine.sockets_before_tp = before
    yield engine
    engine.shutdown()


def test_the_rendezvous_and_gloo_listen_on_loopback_only(tp_engine):
    rank0 = listening_addresses(os.getpid()) - tp_engine.sockets_before_tp
    rank1 = listening_addresses(tp_engine.runner.workers[0].process.pid)
    assert len(rank0) >= 2 and rank1  # rank 0: the TCPStore and gloo; rank 1: gloo
    assert all(is_loopback(address) for address, _ in rank0 | rank1), rank0 | rank1


@pytest.mark.parametrize("addr", ["0.0.0.0:29500", "[::]:29500", "*:29500", "host", ":1"])
def test_a_wildcard_or_malformed_init_addr_is_refused(addr):
    with pytest.raises(ValueError, match="--dist-init-addr"):
        ParallelConfig(tp_size=2, dist_init_addr=addr).verify()


def test_a_taken_init_addr_is_a_clear_error_before_any_rank_starts(tiny_models):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ValueError, match="--dist-init-addr .*cannot listen"):
            TPModelRunner.create(
                LoadConfig(model=str(tiny_models["llama"]), device="cpu"),
                CacheConfig(page_size=16, max_total_tokens=1024),
                ParallelConfig(tp_size=2, dist_init_addr=addr),
            )


def test_engine_tp2_cache_hits_logprobs_grammar_and_retraction_match_one_process(
    tp_engine, tiny_chat_model
):
    one = make_engine(tiny_chat_model, max_total_tokens=640, chunked_prefill_size=64)
    prompts = [SYSTEM[:60] + prompt_ids(i, 12) for i in range(3)]
    args = {"input_ids": prompts, "sampling_params": greedy(6), "return_logprob": True}
    for _ in ("cold", "warm"):
        got, want = tp_engine.generate(**args), one.generate(**args)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        for g, w in zip(got, want):
            g_lp = [lp for lp, *_ in g["meta_info"]["output_token_logprobs"]]
            w_lp = [lp for lp, *_ in w["meta_info"]["output_token_logprobs"]]
            assert g_lp == pytest.approx(w_lp, abs=1e-4)
    assert got[0]["meta_info"]["cached_tokens"] == 64  # the warm round hit the tree
    constrained = {"input_ids": prompts[0], "sampling_params": greedy(8, regex="[0-9]{3}")}
    got, want = tp_engine.generate(**constrained), one.generate(**constrained)
    assert got["output_ids"] == want["output_ids"] and got["text"].isdigit()  # mask on rank 0
    many = [prompt_ids(i, 24) for i in range(16)]
    got = tp_engine.generate(input_ids=many, sampling_params=greedy(60))
    want = one.generate(input_ids=many, sampling_params=greedy(60))
    assert tp_engine.get_stats()["retractions"] > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    tp_engine.check_integrity()
    one.shutdown()


def test_a_killed_rank_ends_the_engine_with_an_error(tp_engine):
    worker = tp_engine.runner.workers[0]
    os.kill(worker.process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1 exited"):
        tp_engine.generate(input_ids=[prompt_ids(0, 8)], sampling_params=greedy(4))
    assert time.monotonic() - start < KILL_DEADLINE_S
    with pytest.raises(RuntimeError):  # the engine stays down
        tp_engine.generate(input_ids=[prompt_ids(1, 8)], sampling_params=greedy(4))
    tp_engine.shutdown()
    assert not worker.process.is_alive()


@pytest.mark.parametrize(
    ("kv_heads", "tp_size", "kv_of_rank"), [(2, 4, [0, 0, 1, 1]), (4, 2, [0, 2])]
)
def test_shard_layout_splits_heads_and_replicates_kv_heads(kv_heads, tp_size, kv_of_rank):
    from radixserve.config import ModelConfig
    from radixserve.model.tp_shard import ShardLayout

    hf = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
        "vocab_size": 256, "attention_bias": True,
    }  # fmt: skip
    config = ModelConfig.from_hf_dict(hf)
    layouts = [ShardLayout(config, rank, tp_size) for rank in range(tp_size)]
    assert [lay.kv_head_start for lay in layouts] == kv_of_rank
    for name, dim in (("model.layers.0.self_attn.q_proj.weight", 0),
                      ("model.layers.0.mlp.down_proj.weight", 1),
                      ("model.embed_tokens.weight", 0)):  # fmt: skip
        full = torch.randn(256 if "embed" in name else 64, 64 if dim == 0 else 128)
        parts = [lay.select(name, full) for lay in layouts]
        torch.testing.assert_close(torch.cat(parts, dim=dim), full)
    bias = torch.ones(64)  # row-parallel bias: summed over ranks it must count once
    total = sum(lay.select("model.layers.0.self_attn.o_proj.bias", bias) for lay in layouts)
    torch.testing.assert_close(total, bias)
