"""--kv-cache-dtype: a KV pool in another dtype than the model's, and its errors."""

from __future__ import annotations

import pytest
import torch
from test_quantization import _logits

from radixserve.config import CacheConfig, LoadConfig
from radixserve.model.runner import ModelRunner


@pytest.mark.parametrize(
    ("dtype", "kv", "bound"), [("float32", "bfloat16", 0.02), ("bfloat16", "float32", 0.05)]
)
def test_kv_cache_dtype_can_differ_from_the_model_dtype(tiny_models, dtype, kv, bound):
    def runner(**kwargs):
        load = LoadConfig(model=str(tiny_models["llama"]), device="cpu", dtype=dtype)
        return ModelRunner.create(load, CacheConfig(max_total_tokens=1024, **kwargs))

    mixed = runner(kv_cache_dtype=kv)
    assert mixed.pool.dtype == getattr(torch, kv)
    assert mixed.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    logits, reference = _logits(mixed), _logits(runner())
    assert (logits - reference).norm() / reference.norm() < bound


def test_kv_cache_dtype_errors_name_the_flag(tiny_models):
    load = LoadConfig(model=str(tiny_models["llama"]), device="cpu")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be auto or one of"):
        ModelRunner.create(load, CacheConfig(max_total_tokens=256, kv_cache_dtype="fp8"))
    other_backend = CacheConfig(
        max_total_tokens=256, kv_cache_dtype="bfloat16", attention_backend="triton"
    )
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 differs.*torch_native"):
        ModelRunner.create(load, other_backend)
