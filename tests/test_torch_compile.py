"""--enable-torch-compile: CPU decode steps compiled per padded batch size, against eager.

Most tests pass a stand-in compiler (the step itself, uncompiled) to check padding, static
buffers and the fallback without paying inductor's compile time; one test compiles for real
(one batch size of a tiny model, ~10-30 s on 2 cores), and a slow one the quantized layers.
"""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from conftest import greedy_generate, prompt_ids
from radixserve.cli_args import add_dataclass_args
from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model import cpu_compile
from radixserve.model.cpu_compile import CompiledDecodeRunner
from radixserve.model.cuda_graph import capture_batch_sizes
from radixserve.model.runner import ModelRunner

PAGE_SIZE = 16
# Inductor fuses the small ops (norms, RoPE, SiLU) into its own loops, so fp32 sums are
# reordered: logits agree to float rounding, not bit for bit.
LOGITS_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def _needs_cpu_ops(cpu_ops):
    """Every test here compiles around the C++ kernels."""


def _runner(model, compile_=False, backend="cpu_fused", **load) -> ModelRunner:
    cache = CacheConfig(
        page_size=PAGE_SIZE,
        max_total_tokens=4096,
        attention_backend=backend,
        enable_torch_compile=compile_,
        torch_compile_max_bs=8,
    )
    return ModelRunner.create(LoadConfig(model=str(model), device="cpu", **load), cache)


def _with_stand_in(runner: ModelRunner, max_bs: int = 8, compiler=lambda step: step):
    """Attaches a CompiledDecodeRunner whose `compiler` is given (default: no compile)."""
    runner.compiled_decode = CompiledDecodeRunner(
        runner.model, runner.attn, capture_batch_sizes(max_bs), runner.graph_max_pages(),
        PAGE_SIZE, compiler=compiler,
    )  # fmt: skip
    return runner


def _decode_batch(runner: ModelRunner, seq_lens: list[int]) -> ForwardBatch:
    """A decode batch over pages filled with the same random K/V in every runner."""
    gen = torch.Generator().manual_seed(0)
    runner.pool.k.copy_(torch.randn(runner.pool.k.shape, generator=gen))
    runner.pool.v.copy_(torch.randn(runner.pool.v.shape, generator=gen))
    tables, next_page = [], 1
    for n in seq_lens:
        num = -(-n // PAGE_SIZE)
        tables.append(list(range(next_page, next_page + num)))
        next_page += num
    ids = [[(7 * i + 3) % 200] for i in range(len(seq_lens))]
    return ForwardBatch.build(ids, [n - 1 for n in seq_lens], tables, PAGE_SIZE)


@pytest.mark.parametrize("seq_lens", [[5], [17, 40, 3], [9] * 5, [33] * 8])
def test_padded_decode_matches_eager(tiny_models, seq_lens):
    eager = _runner(tiny_models["llama"])
    padded = _with_stand_in(_runner(tiny_models["llama"]))
    want = eager.forward(_decode_batch(eager, seq_lens)).last
    batch = _decode_batch(padded, seq_lens)
    got = padded.forward(batch).last
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the batch's K/V went to its slots; padding rows only into scratch page 0
    torch.testing.assert_close(padded.pool.k[:, PAGE_SIZE:], eager.pool.k[:, PAGE_SIZE:])
    assert padded.compiled_decode.compiled == {padded.compiled_decode.padded_size(len(seq_lens))}


def test_what_does_not_fit_runs_eagerly(tiny_models):
    runner = _with_stand_in(_runner(tiny_models["llama"]), max_bs=4)
    compiled = runner.compiled_decode
    assert not compiled.can_run(_decode_batch(runner, [5] * 5))  # above max_bs
    extend = ForwardBatch.build([[1, 2]], [0], [[1]], PAGE_SIZE)
    assert not compiled.can_run(extend)
    runner.forward(_decode_batch(runner, [5] * 5))
    assert compiled.compiled == set()


def test_compile_failure_falls_back_to_eager_once(tiny_models, caplog):
    calls = []

    def broken(step):
        def run(batch):
            calls.append(batch.num_reqs)
            raise RuntimeError("InductorError: no working C++ compiler\nlong trace")

        return run

    eager = _runner(tiny_models["llama"])
    runner = _with_stand_in(_runner(tiny_models["llama"]), compiler=broken)
    with caplog.at_level(logging.WARNING, logger="radixserve.model.cpu_compile"):
        for _ in range(2):
            got = runner.forward(_decode_batch(runner, [6, 7])).last
    want = eager.forward(_decode_batch(eager, [6, 7])).last
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert calls == [2]  # tried once, then eager for good
    assert not runner.compiled_decode.can_run(_decode_batch(runner, [6]))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "running eagerly" in warnings[0]
    assert "no working C++ compiler" in warnings[0] and "long trace" not in warnings[0]


def test_flag_is_ignored_with_a_reason_where_it_cannot_work(tiny_models, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="radixserve.model.runner"):
        runner = _runner(tiny_models["llama"], compile_=True, backend="torch_native")
    assert runner.compiled_decode is None
    assert "needs the cpu_fused attention backend" in caplog.text
    monkeypatch.setattr(cpu_compile.shutil, "which", lambda name: None)
    reason = cpu_compile.compile_unavailable_reason(
        runner.model, _runner(tiny_models["llama"]).attn
    )
    assert "C++ compiler" in reason


def test_flags_reach_the_cli_and_are_validated():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, CacheConfig, "KV cache")
    args = parser.parse_args(["--enable-torch-compile", "--torch-compile-max-bs", "16"])
    assert args.enable_torch_compile is True and args.torch_compile_max_bs == 16
    defaults = parser.parse_args([])
    assert defaults.enable_torch_compile is False and defaults.torch_compile_max_bs == 32
    with pytest.raises(ValueError, match="--torch-compile-max-bs must be >= 1"):
        CacheConfig(torch_compile_max_bs=0)


def test_the_pool_write_op_writes_in_place():
    k, v = torch.zeros(10, 2, 4), torch.zeros(10, 2, 4)
    new_k, new_v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    torch.ops.radixserve.kv_write_slots(k, v, torch.tensor([3, 7]), new_k, new_v)
    assert torch.equal(k[7], new_k[1]) and torch.equal(v[3], new_v[0]) and k[0].abs().sum() == 0


def _compare_compiled(model, prompts, num_tokens, **load):
    """Greedy tokens identical and decode logits close, compiled (inductor) vs eager."""
    eager, compiled = _runner(model, **load), _runner(model, compile_=True, **load)
    assert compiled.compiled_decode is not None
    assert greedy_generate(compiled, prompts, num_tokens) == greedy_generate(
        eager, prompts, num_tokens
    )
    assert compiled.compiled_decode.compiled == {compiled.compiled_decode.padded_size(len(prompts))}
    assert compiled.compiled_decode.failure is None
    lens = [len(p) for p in prompts]
    want = eager.forward(_decode_batch(eager, lens)).last
    torch.testing.assert_close(
        compiled.forward(_decode_batch(compiled, lens)).last, want, **LOGITS_TOL
    )


def test_inductor_decode_matches_eager(tiny_models):
    """The one real compile of the default run: batch 3 (padded to 4), fp32."""
    prompts = [prompt_ids(i, length)[:length] for i, length in enumerate([5, 20, 33])]
    prompts = [[t % 256 for t in p] for p in prompts]
    _compare_compiled(tiny_models["llama"], prompts, num_tokens=6)


@pytest.mark.slow
def test_inductor_decode_of_gguf_layers_on_the_block_kernels(tmp_path):
    """The C++ block matmuls inside a compiled step (their fake kernels give the tracer the
    output shapes); the tiny GGUF's Q4_0 / Q4_1 / Q8_0 layers."""
    from test_quantization_gguf import save_plain_llama, write_tiny_gguf

    write_tiny_gguf(save_plain_llama(tmp_path / "hf"), tmp_path / "tiny.gguf")
    prompts = [[(i * 31 + 5) % 256 for i in range(12)]]
    torch._dynamo.utils.counters.clear()
    _compare_compiled(tmp_path / "tiny.gguf", prompts, num_tokens=4, quantization="gguf")
    assert not torch._dynamo.utils.counters["graph_break"]  # the ops are in the graph


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_inductor_decode_of_quantized_linears(tiny_models, quantization):
    prompts = [[(i * 31 + 5) % 256 for i in range(12)]]
    _compare_compiled(tiny_models["qwen2"], prompts, num_tokens=4, quantization=quantization)
