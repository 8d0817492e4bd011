"""--cpu-decode-stack: a pure decode batch's layers as one C++ call (model/cpu_decode_stack.py),
and a batch of in-place extends' (speculative verifies: chains and draft trees over cached
pages, with EAGLE's captured hidden states), give the modules' logits bit for bit (the same
ops, in the same order) on every projection kind it runs: fp layers with and without bias
(Llama, Qwen2; torch's matmul and the packed kernel), Qwen3's q/k norms, and a GGUF file of
every block type (Q4_K / Q5_K / Q6_K / Q4_0 / Q8_0) on fp32 and on int8 activations (8-row
repacked where AVX-512 has them); prefills without a cached prefix and mixed steps stay on the
modules, and models it does not cover (sliding windows, Gemma 3, deterministic inference) say
why and run the modules."""

from __future__ import annotations

import logging

import pytest
import torch
from test_kquant_gguf import _needs_blocks, save_llama, write_kquant_gguf

from conftest import make_runner, prompt_ids
from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import FINAL_HIDDEN
from radixserve.model.runner import ModelRunner


def _ids(i: int, length: int) -> list[int]:
    return [t % 256 for t in prompt_ids(i, length)]


def _decode_logits(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list:
    """Prefill `prompts` together, then `steps` greedy decode steps of all of them: each
    step's last-token logits; frees the pages."""
    pool = runner.pool
    tables = [[] for _ in prompts]
    lens = [0] * len(prompts)
    new = [list(p) for p in prompts]
    logits = []
    try:
        for _ in range(steps + 1):
            tables = [pool.extend_page_table(t, n + len(x)) for t, n, x in zip(tables, lens, new)]
            batch = ForwardBatch.build(new, lens, tables, pool.page_size, runner.device)
            out = runner.forward(batch).last
            logits.append(out)
            lens = [n + len(x) for n, x in zip(lens, new)]
            new = [[t] for t in out.argmax(-1).tolist()]
    finally:
        for table in tables:
            pool.allocator.free(table)
    return logits


def _assert_stack_is_the_modules(runner: ModelRunner, prompts: list[list[int]], steps: int):
    stack = runner.model.decode_stack
    assert stack is not None, "the model should run on the C++ decode stack"
    before = stack.calls
    fused = _decode_logits(runner, prompts, steps)
    assert stack.calls - before == steps  # every decode step, not the prefill
    runner.model.decode_stack = None
    try:
        modules = _decode_logits(runner, prompts, steps)
    finally:
        runner.model.decode_stack = stack
    for step, (got, want) in enumerate(zip(fused, modules)):
        assert torch.equal(got, want), f"step {step}: the stack's logits differ from the modules'"


def _verify_outputs(runner: ModelRunner, prompts: list[list[int]], aux_layers: tuple) -> list:
    """Prefill `prompts`, then one batch of verify-shaped extends over their pages (request
    0: a chain of 4 tokens, request 1: a root and a 4-node draft tree, request 2: 2 tokens):
    every row's logits and the captured hidden states; frees the pages."""
    pool = runner.pool
    lens = [0] * len(prompts)
    tables = [pool.extend_page_table([], len(p)) for p in prompts]
    runner.aux_layers = aux_layers
    try:
        runner.forward(ForwardBatch.build(prompts, lens, tables, pool.page_size))
        lens = [len(p) for p in prompts]
        new = [[7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17]][: len(prompts)]
        parents = [None, [0, 0, 1, 2], None][: len(prompts)]
        tables = [pool.extend_page_table(t, n + len(x)) for t, n, x in zip(tables, lens, new)]
        rows = list(range(sum(len(x) for x in new)))
        batch = ForwardBatch.build(
            new, lens, tables, pool.page_size, verify_indices=rows, tree_parents=parents
        )
        out = runner.forward(batch)
        return [out.verify, out.last] + ([] if out.aux_hidden is None else [out.aux_hidden])
    finally:
        runner.aux_layers = ()
        for table in tables:
            pool.allocator.free(table)


@pytest.mark.parametrize("aux_layers", [(), (0, 1, 2), (2, FINAL_HIDDEN, 1, 1)])
def test_verify_extends_run_the_stack_with_the_modules_bits(tiny_models, cpu_ops, aux_layers):
    """Chains and draft trees over cached pages (cpu_fused's paged_extend) run the stack, and
    its logits and aux hidden states (EAGLE's capture: layer inputs, after the last, the
    final-normed rows; in any order, repeated) are the modules' bits."""
    runner = make_runner(tiny_models["llama"])
    assert runner.model.config.num_layers == 2
    stack = runner.model.decode_stack
    prompts = [_ids(8, 13), _ids(9, 16), _ids(10, 5)]
    before = stack.calls
    fused = _verify_outputs(runner, prompts, aux_layers)
    assert stack.calls - before == 1  # the verify batch (the prefill has no cached prefix)
    runner.model.decode_stack = None
    try:
        modules = _verify_outputs(runner, prompts, aux_layers)
    finally:
        runner.model.decode_stack = stack
    assert len(fused) == len(modules) == (3 if aux_layers else 2)
    for got, want in zip(fused, modules):
        assert torch.equal(got, want), "the stack's verify differs from the modules'"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fp_models_decode_the_modules_bits(tiny_models, cpu_ops, arch):
    runner = make_runner(tiny_models[arch])
    # three requests of different lengths, each across a page boundary (page size 16)
    prompts = [_ids(0, 5), _ids(1, 19), _ids(2, 30)]
    _assert_stack_is_the_modules(runner, prompts, steps=6)
    _assert_stack_is_the_modules(runner, prompts[:1], steps=3)


def test_the_packed_dense_kernel_decodes_the_modules_bits(tiny_models, cpu_ops):
    """--cpu-dense-kernel packed (auto's choice on AMD EPYC at real sizes): its fp layers."""
    load = LoadConfig(model=str(tiny_models["qwen2"]), device="cpu", cpu_dense_kernel="packed")
    runner = ModelRunner.create(load, CacheConfig(max_total_tokens=1024))
    assert type(runner.model.layers[0].self_attn.qkv_proj).__name__ == "BatchInvariantLinear"
    _assert_stack_is_the_modules(runner, [_ids(6, 7), _ids(7, 18)], steps=4)


@pytest.fixture(scope="module")
def block_gguf(tmp_path_factory):
    """The K-quant test's tiny file: Q4_K_M's mix in layer 0, Q4_0 / Q8_0 / Q5_K in layer 1,
    a Q6_K head."""
    from gguf import GGMLQuantizationType as T

    root = tmp_path_factory.mktemp("decode_stack_gguf")
    write_kquant_gguf(save_llama(root / "hf", tie=False), root / "tiny.gguf", head=T.Q6_K)
    return root / "tiny.gguf"


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_every_gguf_block_type_decodes_the_modules_bits(cpu_ops, block_gguf, activations):
    _needs_blocks()  # without AVX2 / AVX-512 the file runs torch's int kernels: modules
    load = LoadConfig(
        model=str(block_gguf), device="cpu", dtype="float32", cpu_quant_activation=activations
    )
    runner = ModelRunner.create(load, CacheConfig(max_total_tokens=512))
    prompts = [_ids(3, 9), _ids(4, 21)]
    _assert_stack_is_the_modules(runner, prompts, steps=5)


def test_off_and_uncovered_models_run_the_modules(tiny_models, cpu_ops, caplog):
    cache = CacheConfig(max_total_tokens=1024)
    off = LoadConfig(model=str(tiny_models["llama"]), device="cpu", cpu_decode_stack="off")
    assert ModelRunner.create(off, cache).model.decode_stack is None
    deterministic = LoadConfig(
        model=str(tiny_models["llama"]), device="cpu", enable_deterministic_inference=True
    )
    with caplog.at_level(logging.INFO, logger="radixserve.model.cpu_decode_stack"):
        runner = ModelRunner.create(deterministic, cache)
    assert runner.model.decode_stack is None
    assert "no C++ decode stack" in caplog.text and "attention backend" in caplog.text
    for arch in ("mistral", "gemma3"):  # per-layer windows: their own attention backend
        other = ModelRunner.create(LoadConfig(model=str(tiny_models[arch]), device="cpu"), cache)
        assert other.model.decode_stack is None
        assert len(_decode_logits(other, [_ids(5, 30)], steps=2)) == 3


def test_an_unknown_choice_names_the_flag(tiny_models):
    load = LoadConfig(model=str(tiny_models["llama"]), device="cpu", cpu_decode_stack="fast")
    with pytest.raises(ValueError, match="--cpu-decode-stack must be one of auto, off"):
        ModelRunner.create(load, CacheConfig(max_total_tokens=256))
