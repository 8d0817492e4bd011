"""The triton attention backend gives torch_native's logits (run on CPU by the interpreter)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before radixserve_kernels is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from conftest import greedy_generate  # noqa: E402
from radixserve.config import CacheConfig, LoadConfig  # noqa: E402
from radixserve.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.runner import ModelRunner  # noqa: E402

PROMPTS = [[(i * 31 + j * 7) % 256 for j in range(n)] for i, n in enumerate([30, 5, 19])]


def _runner(folder, backend: str, page_size: int) -> ModelRunner:
    return ModelRunner.create(
        LoadConfig(model=str(folder), device="cpu"),
        CacheConfig(page_size=page_size, max_total_tokens=1024, attention_backend=backend),
    )


def _mixed_batch_logits(runner: ModelRunner) -> torch.Tensor:
    """Prefill two prompts' prefixes, then one batch: two extends over them + one fresh."""
    pool = runner.pool
    tables = [pool.extend_page_table([], len(p)) for p in PROMPTS]
    cached = [17, 4, 0]
    warm = [i for i, c in enumerate(cached) if c]
    runner.forward(ForwardBatch.build(
        [PROMPTS[i][: cached[i]] for i in warm], [0] * len(warm), [tables[i] for i in warm],
        pool.page_size,
    ))  # fmt: skip
    batch = ForwardBatch.build(
        [p[c:] for p, c in zip(PROMPTS, cached)], cached, tables, pool.page_size,
        return_all_logits=True,
    )  # fmt: skip
    return runner.forward(batch).all


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_matches_torch_native(tiny_models, arch, page_size):
    native = _runner(tiny_models[arch], "torch_native", page_size)
    triton_runner = _runner(tiny_models[arch], "triton", page_size)
    expected = _mixed_batch_logits(native)
    torch.testing.assert_close(_mixed_batch_logits(triton_runner), expected, atol=1e-4, rtol=0)
    # decode steps (the split-K kernel, or the extend kernel under a sliding window)
    assert greedy_generate(triton_runner, PROMPTS, 6) == greedy_generate(native, PROMPTS, 6)


@torch.inference_mode()
def test_triton_backend_verifies_a_draft_tree_as_torch_native(tiny_models):
    """A tree verify (EAGLE3, --speculative-eagle-topk > 1) beside a decode: the triton
    backend masks the tree (supports_tree_mask) and gives torch_native's logits."""
    logits = []
    for backend in ("torch_native", "triton"):
        runner = _runner(tiny_models["llama"], backend, 16)
        assert runner.attn.supports_tree_mask
        pool = runner.pool
        tables = [pool.extend_page_table([], n) for n in (30, 6)]
        runner.forward(ForwardBatch.build([PROMPTS[0][:22], PROMPTS[1]], [0, 0], tables, 16))
        batch = ForwardBatch.build(
            [PROMPTS[0][22:], [9]], [22, 5], tables, 16, return_all_logits=True,
            tree_parents=[[0, 0, 1, 1, 3], None],  # 2 plain tokens, the root, 5 nodes
        )  # fmt: skip
        logits.append(runner.forward(batch).all)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)
