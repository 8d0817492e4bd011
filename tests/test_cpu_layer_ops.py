"""The fused C++ CPU layer ops (model/cpu_layer_ops.py) against their torch references in
model/layers.py, and whole models with them on vs off: the same greedy tokens, cold and warm
cache, mixed prefill + decode batches, every architecture of the tiny set (Qwen3's qk_norm,
Qwen2's qkv bias, Mistral's sliding window)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import SYSTEM, greedy, greedy_generate, make_engine, make_runner, prompt_ids
from radixserve.config import CacheConfig, LoadConfig
from radixserve.forward_batch import ForwardBatch
from radixserve.model.cpu_layer_ops import CpuLayerOps
from radixserve.model.layers import RMSNorm, RotaryAt
from radixserve.model.runner import ModelRunner

DTYPES = [torch.float32, torch.bfloat16]


def _ids(i: int, length: int) -> list[int]:
    """Prompt ids inside the tiny models' vocabulary of 256."""
    return [t % 256 for t in prompt_ids(i, length)]


@pytest.fixture(scope="module")
def layer_ops(cpu_ops) -> CpuLayerOps:
    return CpuLayerOps(cpu_ops)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: a few ulps (the op sums in another order); bf16: one rounding step apart."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = (
        {"atol": 1e-5, "rtol": 1e-5} if got.dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    )
    torch.testing.assert_close(got, want, **tol)


def _norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(dim, eps=1e-5).to(dtype)
    norm.weight.data = torch.rand(dim).add(0.5).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (7, 576), (33, 128)])
def test_rms_norm_and_add_rms_norm_match_the_reference(layer_ops, rows, dim, dtype):
    torch.manual_seed(rows)
    norm = _norm(dim, dtype)
    x, residual = (torch.randn(rows, dim).mul(3).to(dtype) for _ in range(2))
    _close(layer_ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    want_x, want_residual = norm(x, residual)
    got_x, got_residual = x.clone(), residual.clone()
    layer_ops.add_rms_norm(got_x, got_residual, norm.weight, norm.eps)  # in place
    assert torch.equal(got_residual, want_residual)  # one rounding of one add: exact
    _close(got_x, want_x)
    heads = torch.randn(rows, 3, dim).to(dtype)  # leading dims, as q_norm's [tokens, heads, dim]
    _close(layer_ops.rms_norm(heads, norm.weight, norm.eps), norm(heads))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 64), (5, 1536)])
def test_silu_mul_matches_the_reference(layer_ops, rows, inter, dtype):
    gate_up = torch.randn(rows, 2 * inter).mul(4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(layer_ops.silu_mul(gate_up), F.silu(gate) * up)


def _rope_case(tokens, heads, kv_heads, dim, dtype, qk_norm):
    torch.manual_seed(tokens * dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    angles = torch.rand(tokens, dim // 2) * 6.0
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    norms = (_norm(dim, dtype), _norm(dim, dtype)) if qk_norm else None
    return qkv, cos, sin, norms


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(
    "tokens, heads, kv_heads, dim, page_size, dtype, pool_dtype",
    [
        (1, 9, 3, 64, 16, torch.float32, torch.float32),  # SmolLM2's decode shape
        (13, 8, 2, 128, 1, torch.float32, torch.float32),
        (6, 4, 4, 64, 16, torch.bfloat16, torch.bfloat16),
        (5, 4, 1, 128, 16, torch.float32, torch.bfloat16),  # a pool that casts
    ],
)
def test_rope_store_rotates_in_place_and_writes_the_slots(
    layer_ops, tokens, heads, kv_heads, dim, page_size, dtype, pool_dtype, qk_norm
):
    qkv, cos, sin, norms = _rope_case(tokens, heads, kv_heads, dim, dtype, qk_norm)
    num_slots = 8 * page_size * tokens
    slots = torch.randperm(num_slots)[:tokens]  # scattered over pages
    k_pool, v_pool = (torch.zeros(num_slots, kv_heads, dim, dtype=pool_dtype) for _ in range(2))
    # the reference: LlamaAttention's torch path and KVPool.write
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.reshape(tokens, -1, dim) for t in (q, k, v))
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    want_q, want_k = RotaryAt(cos.unsqueeze(1), sin.unsqueeze(1))(q, k)
    want_k_pool = k_pool.index_copy(0, slots, want_k.to(pool_dtype))
    want_v_pool = v_pool.index_copy(0, slots, v.to(pool_dtype))

    weights = None if norms is None else (norms[0].weight, norms[1].weight)
    got = qkv.clone()
    layer_ops.rope_store(
        got, cos, sin, (k_pool, v_pool), slots, (heads, kv_heads, dim), weights, 1e-5
    )
    got_q, got_k, got_v = got.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    _close(got_q.reshape(tokens, heads, dim), want_q)
    _close(got_k.reshape(tokens, kv_heads, dim), want_k)
    assert torch.equal(got_v, qkv[:, (heads + kv_heads) * dim :])  # v left as it was
    _close(k_pool, want_k_pool)
    assert torch.equal(v_pool, want_v_pool)


def test_rope_store_rejects_a_slot_outside_the_pool(layer_ops):
    qkv, cos, sin, _ = _rope_case(2, 2, 1, 64, torch.float32, False)
    pool = torch.zeros(16, 1, 64)
    with pytest.raises(RuntimeError, match="slots\\[1\\] = 16 is not a slot"):
        layer_ops.rope_store(qkv, cos, sin, (pool, pool), torch.tensor([3, 16]), (2, 1, 64),
                             None, 1e-5)  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_model_with_fused_ops_decodes_the_same_greedy_tokens(tiny_models, cpu_ops, arch):
    prompts = [_ids(i, 20 + 7 * i) for i in range(3)]
    runner = make_runner(tiny_models[arch])
    assert runner.model.layers[0].mlp.ops is not None  # on by default on CPU
    fused = greedy_generate(runner, prompts, 12)
    runner.model.use_cpu_layer_ops(None)
    assert greedy_generate(runner, prompts, 12) == fused


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_mixed_batch_gives_the_reference_logits(tiny_models, cpu_ops, arch, dtype):
    """One forward of a decode, an extend over a cached prefix and a fresh prefill."""
    runner = ModelRunner.create(
        LoadConfig(model=str(tiny_models[arch]), device="cpu", dtype=dtype),
        CacheConfig(max_total_tokens=1024, page_size=16),
    )
    assert runner.attn.accepts_stored_kv and runner.model.layers[0].self_attn.ops is not None
    pool = runner.pool
    tables = [pool.extend_page_table([], 64) for _ in range(3)]
    warm = ForwardBatch.build([_ids(0, 40), _ids(1, 20)], [0, 0], tables[:2], 16)
    runner.forward(warm)  # K/V of the two cached prefixes

    def mixed() -> torch.Tensor:
        tokens = [[7], _ids(2, 9), _ids(3, 25)]
        batch = ForwardBatch.build(tokens, [40, 20, 0], tables, 16, return_all_logits=True)
        return runner.forward(batch).all

    fused = mixed()
    runner.model.use_cpu_layer_ops(None)
    tol = 1e-4 if dtype == "float32" else 2e-2  # bf16: a rounding step of the logits' scale
    torch.testing.assert_close(fused, mixed(), atol=tol, rtol=tol)


def test_engine_tokens_are_the_same_with_fused_ops_off_cold_and_warm(tiny_chat_model, cpu_ops):
    prompts = [SYSTEM + prompt_ids(i, 20) for i in range(3)]
    outputs = []
    for fused in (True, False):
        engine = make_engine(tiny_chat_model)
        if not fused:
            engine.runner.model.use_cpu_layer_ops(None)
        cold = engine.generate(input_ids=prompts, sampling_params=greedy(10))
        warm = engine.generate(input_ids=prompts, sampling_params=greedy(10))
        assert [o["output_ids"] for o in cold] == [o["output_ids"] for o in warm]
        assert warm[0]["meta_info"]["cached_tokens"] > 0
        outputs.append([o["output_ids"] for o in cold])
        engine.shutdown()
    assert outputs[0] == outputs[1]


def test_a_float16_pool_keeps_the_torch_reference(tiny_models, cpu_ops):
    """The ops take float32 / bfloat16; other dtypes run the reference, and still decode."""
    runner = ModelRunner.create(
        LoadConfig(model=str(tiny_models["llama"]), device="cpu"),
        CacheConfig(
            max_total_tokens=1024, kv_cache_dtype="float16", attention_backend="torch_native"
        ),
    )
    assert runner.model.layers[0].mlp.ops is None
    assert len(greedy_generate(runner, [_ids(0, 20)], 4)[0]) == 4
