"""Decode CUDA graphs, checked on CPU: a stand-in graph replays the captured callable on the
static buffers (what a CUDA graph's recorded kernels do) and fails on host syncs (which capture
forbids), so padding, buffer copies and graph-safe attention metadata are tested against the
plain forward with the torch_native and triton (interpreted) backends."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before radixserve_kernels is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from radixserve.cli_args import add_dataclass_args  # noqa: E402
from radixserve.config import CacheConfig, LoadConfig, ModelConfig  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.cuda_graph import (  # noqa: E402
    DecodeGraphBuffers,
    capture_batch_sizes,
    estimate_graph_memory,
)
from radixserve.model.runner import ModelRunner, kv_budget_bytes  # noqa: E402
from radixserve.model.source import builtin_config  # noqa: E402

aten = torch.ops.aten
HOST_SYNC_OPS = {
    aten._local_scalar_dense.default,  # .item(), int(t), float(t)
    aten.item.default,  # the same, as seen under inference_mode
    aten.nonzero.default,  # boolean-mask indexing
    aten.is_nonzero.default,  # bool(t)
    aten.equal.default,
}
PAGE_SIZE = 4
PROMPTS = [[(i * 37 + j * 11) % 256 for j in range(n)] for i, n in enumerate([7, 2, 30, 5, 9])]


class NoHostSync(TorchDispatchMode):
    """Fails on ops that make the host wait for the device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNC_OPS:
            raise AssertionError(f"host sync inside a captured region: {func}")
        return func(*args, **(kwargs or {}))


class EagerGraph:
    """CPU stand-in for a CUDA graph: each replay reruns the captured callable."""

    def capture(self, fn):
        self.fn = fn
        self.replay()

    def replay(self) -> torch.Tensor:
        with NoHostSync():
            return self.fn()


def _runner(folder, backend: str, graphs: bool) -> ModelRunner:
    runner = ModelRunner.create(
        LoadConfig(model=str(folder), device="cpu"),
        CacheConfig(page_size=PAGE_SIZE, max_total_tokens=1024, attention_backend=backend),
    )
    assert runner.decode_graphs is None  # never on CPU by itself
    if graphs:
        runner.capture_decode_graphs(8, new_graph=EagerGraph)
    return runner


class Seqs:
    """Requests' tokens and page tables on one runner, stepped by hand."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]):
        self.runner = runner
        self.ids = [list(p) for p in prompts]
        self.tables: list[list[int]] = [[] for _ in prompts]
        self.computed = [0] * len(prompts)

    def batch(self, reqs: list[int], all_logits: bool = False) -> ForwardBatch:
        pool = self.runner.pool
        for i in reqs:
            self.tables[i] = pool.extend_page_table(self.tables[i], len(self.ids[i]))
        batch = ForwardBatch.build(
            [self.ids[i][self.computed[i] :] for i in reqs],
            [self.computed[i] for i in reqs],
            [self.tables[i] for i in reqs],
            pool.page_size,
            return_all_logits=all_logits,
        )
        for i in reqs:
            self.computed[i] = len(self.ids[i])
        return batch

    def step(self, reqs: list[int], all_logits: bool = False):
        return self.runner.forward(self.batch(reqs, all_logits))

    def append(self, reqs: list[int], logits: torch.Tensor) -> None:
        for i, token in zip(reqs, logits.argmax(-1).tolist()):
            self.ids[i].append(token)


def _check_step(plain: Seqs, graphed: Seqs, reqs: list[int], replayed: bool) -> None:
    graphs = graphed.runner.decode_graphs
    before = graphs.num_replays
    expected = plain.step(reqs).last
    got = graphed.step(reqs).last
    assert graphs.num_replays == before + replayed
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    plain.append(reqs, expected)
    graphed.append(reqs, expected)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_graph_decode_matches_eager_on_ragged_batches(tiny_models, backend, arch):
    if backend == "triton":
        pytest.importorskip("triton")
    plain = Seqs(_runner(tiny_models[arch], backend, graphs=False), PROMPTS)
    graphed = Seqs(_runner(tiny_models[arch], backend, graphs=True), PROMPTS)
    everyone = list(range(len(PROMPTS)))
    _check_step(plain, graphed, everyone, replayed=False)  # prefill: eager
    for reqs in ([0], [1, 2, 3], everyone, everyone, [4, 0, 2]):  # padded to 1, 4, 8, 8, 4
        _check_step(plain, graphed, reqs, replayed=True)
    # padding wrote only the scratch page: every written slot holds what the plain run wrote
    slots = torch.tensor([
        table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        for table, n in zip(plain.tables, plain.computed) for pos in range(n)
    ])  # fmt: skip
    assert graphed.tables == plain.tables and int(slots.min()) >= PAGE_SIZE
    for name in ("k", "v"):
        want = getattr(plain.runner.pool, name)[:, slots]
        got = getattr(graphed.runner.pool, name)[:, slots]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_batches_graphs_cannot_run_go_eager(tiny_models):
    plain = Seqs(_runner(tiny_models["llama"], "torch_native", graphs=False), PROMPTS)
    graphed = Seqs(_runner(tiny_models["llama"], "torch_native", graphs=True), PROMPTS)
    _check_step(plain, graphed, [0, 1, 2], replayed=False)
    plain.ids[3] += [5, 6]  # a mixed batch: decodes plus a fresh prefill
    graphed.ids[3] += [5, 6]
    _check_step(plain, graphed, [0, 1, 2, 3], replayed=False)
    graphs = graphed.runner.decode_graphs
    assert not graphs.can_run(graphed.batch([0, 1], all_logits=True))
    too_many = ForwardBatch.build([[1]] * 9, [0] * 9, [[1]] * 9, PAGE_SIZE)
    assert not graphs.can_run(too_many)
    too_wide = ForwardBatch.build([[1]], [0], [[1] * (graphs.max_pages + 1)], PAGE_SIZE)
    assert not graphs.can_run(too_wide)
    assert graphs.can_run(ForwardBatch.build([[1]] * 8, [0] * 8, [[1]] * 8, PAGE_SIZE))


def test_the_stand_in_catches_host_syncs():
    with torch.inference_mode(), pytest.raises(AssertionError, match="host sync"):
        with NoHostSync():
            int(torch.tensor([3, 5]).max())


def test_capture_batch_sizes_and_padding():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


def test_buffers_load_copies_the_batch_and_pads_to_scratch():
    bufs = DecodeGraphBuffers(8, 6, torch.device("cpu"))
    bufs.page_table.fill_(7)  # stale pages from an earlier, larger batch
    batch = ForwardBatch.build([[11], [12], [13]], [4, 0, 9], [[3, 4], [5], [6, 8, 9]], PAGE_SIZE)
    bufs.load(batch, padded=4)
    assert bufs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert bufs.positions[:4].tolist() == [4, 0, 9, 0]
    assert bufs.seq_lens[:4].tolist() == [5, 1, 10, 1]
    assert bufs.out_slots[:4].tolist() == [4 * 4 + 0, 5 * 4, 9 * 4 + 1, 0]
    assert bufs.page_table[:3, :3].tolist() == [[3, 4, 0], [5, 0, 0], [6, 8, 9]]
    assert bufs.page_table[3, 0] == 0  # padding row: scratch page only


def test_cache_config_options_reach_the_cli():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, CacheConfig, "KV cache")
    args = parser.parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "64"])
    assert args.disable_cuda_graph is True and args.cuda_graph_max_bs == 64
    defaults = parser.parse_args([])
    assert defaults.disable_cuda_graph is False and defaults.cuda_graph_max_bs == 256


def test_graph_memory_estimate_is_kept_out_of_the_kv_budget():
    config = ModelConfig.from_hf_dict(builtin_config("llama-3-8b"))
    estimate = estimate_graph_memory(config, capture_batch_sizes(256), torch.bfloat16)
    assert 256 << 20 < estimate < 2 << 30  # activations of one step, not 35 sets of logits
    small = estimate_graph_memory(config, capture_batch_sizes(16), torch.bfloat16)
    assert small < estimate
    cpu = torch.device("cpu")
    assert kv_budget_bytes(CacheConfig(cpu_kv_cache_gb=4.0), cpu, reserve_bytes=estimate) == 4 << 30
