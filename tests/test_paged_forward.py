"""The paged path gives the same logits however a sequence's KV got into the pool."""

from __future__ import annotations

import pytest
import torch

from conftest import make_runner
from radixserve.forward_batch import ForwardBatch

PROMPT = [(i * 53 + 7) % 256 for i in range(45)]


def _forward(runner, token_ids, prefix_lens, tables, all_logits=False):
    batch = ForwardBatch.build(
        token_ids, prefix_lens, tables, runner.pool.page_size, return_all_logits=all_logits
    )
    return runner.forward(batch)


def _one_go(runner, prompt):
    table = runner.pool.extend_page_table([], len(prompt))
    return _forward(runner, [prompt], [0], [table], all_logits=True).all


@pytest.fixture(params=["llama", "qwen3", "mistral"])
def arch(request):
    return request.param


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("split", [16, 21])
def test_cached_prefix_plus_extend_equals_one_go(tiny_models, arch, page_size, split):
    runner = make_runner(tiny_models[arch], page_size=page_size)
    expected = _one_go(runner, PROMPT)
    table = runner.pool.extend_page_table([], split)
    _forward(runner, [PROMPT[:split]], [0], [table])
    table = runner.pool.extend_page_table(table, len(PROMPT))
    rest = _forward(runner, [PROMPT[split:]], [split], [table], all_logits=True)
    torch.testing.assert_close(rest.all, expected[split:], atol=1e-4, rtol=0)
    torch.testing.assert_close(rest.last[0], expected[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_token_by_token_equals_one_go(tiny_models, arch, page_size):
    runner = make_runner(tiny_models[arch], page_size=page_size)
    expected = _one_go(runner, PROMPT)
    table: list[int] = []
    for pos, token in enumerate(PROMPT):
        table = runner.pool.extend_page_table(table, pos + 1)
        logits = _forward(runner, [[token]], [pos], [table]).last[0]
        torch.testing.assert_close(logits, expected[pos], atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_pages_serve_another_request(tiny_models, page_size):
    """Two requests read the same prefix pages, as radix-cache hits will."""
    runner = make_runner(tiny_models["llama"], page_size=page_size)
    other = PROMPT[:32] + [9, 8, 7, 6, 5]
    expected = _one_go(runner, other)
    owner = runner.pool.extend_page_table([], 32)
    _forward(runner, [PROMPT[:32]], [0], [owner])
    shared = owner[: 32 // page_size]
    table = runner.pool.extend_page_table(shared, len(other))
    out = _forward(runner, [other[32:]], [32], [table], all_logits=True)
    torch.testing.assert_close(out.all, expected[32:], atol=1e-4, rtol=0)


def test_mixed_batch_matches_each_request_alone(tiny_models, arch):
    """Two extends of different lengths (one over a cached prefix) and three decodes."""
    runner = make_runner(tiny_models[arch])
    prompts = [PROMPT[:30], PROMPT[5:45], PROMPT[:7], PROMPT[10:35], PROMPT[3:20]]
    cached = [0, 12] + [len(p) - 1 for p in prompts[2:]]  # the last three decode one token
    tables = []
    for prompt, num_cached in zip(prompts, cached):
        table = runner.pool.extend_page_table([], len(prompt))
        if num_cached:
            _forward(runner, [prompt[:num_cached]], [0], [table])
        tables.append(table)
    new_tokens = [p[c:] for p, c in zip(prompts, cached)]
    alone = [
        _forward(runner, [tokens], [c], [table]).last[0]
        for tokens, c, table in zip(new_tokens, cached, tables)
    ]
    mixed = _forward(runner, new_tokens, cached, tables).last
    assert [len(t) for t in new_tokens] == [30, 28, 1, 1, 1]
    for i, expected in enumerate(alone):
        torch.testing.assert_close(mixed[i], expected, atol=1e-4, rtol=0)


def test_decode_forward_calls_layer_modules_directly(tiny_models, monkeypatch):
    """The Llama layers, attention, MLP and norms (DirectCallModule) run their forward
    without nn.Module.__call__'s hook dispatch, ~9 calls a layer of a decode step; only the
    embedding and the projections go through it. The logits are the same either way."""
    runner = make_runner(tiny_models["llama"], page_size=16)
    table = runner.pool.extend_page_table([], len(PROMPT))
    _forward(runner, [PROMPT[:-1]], [0], [table])
    dispatched: list[str] = []
    call_impl = torch.nn.Module._call_impl

    def counting(module, *args, **kwargs):
        dispatched.append(type(module).__name__)
        return call_impl(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "_call_impl", counting)
    logits = _forward(runner, [PROMPT[-1:]], [len(PROMPT) - 1], [table]).last[0]
    direct = {"LlamaDecoderLayer", "LlamaAttention", "GatedMLP", "RMSNorm"}
    assert dispatched and not direct & set(dispatched)
    torch.testing.assert_close(logits, _one_go(runner, PROMPT)[-1], atol=1e-4, rtol=0)
