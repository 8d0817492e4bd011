"""--cpu-dense-kernel: a CPU model's fp projections and LM head on torch's matmul or on our
packed dense kernel; `auto` measures once per machine (cached) and packs only where ours is
clearly faster."""

from __future__ import annotations

import json

import pytest
import torch
from test_batch_invariance import _decode_and_verify_logits

from radixserve.config import CacheConfig, LoadConfig
from radixserve.model.quant import dense_choice
from radixserve.model.quant.batch_invariant import BatchInvariantLinear
from radixserve.model.quant.linear import UnquantizedLinear
from radixserve.model.runner import ModelRunner


def _runner(folder, kernel: str) -> ModelRunner:
    load = LoadConfig(model=str(folder), device="cpu", quantization="none", cpu_dense_kernel=kernel)
    return ModelRunner.create(load, CacheConfig(page_size=16, max_total_tokens=512))


def _packed(runner: ModelRunner) -> bool:
    modules = list(runner.model.modules())
    if any(isinstance(m, UnquantizedLinear) for m in modules):
        return False
    return isinstance(runner.model.lm_head, BatchInvariantLinear)


def test_packed_moves_every_fp_layer_to_our_kernel_with_the_same_logits(tiny_models, cpu_ops):
    folder = tiny_models["qwen3"]  # tied: the head gets a packed copy of the embedding
    plain, packed = _runner(folder, "torch"), _runner(folder, "packed")
    assert plain.model.lm_head is None and not _packed(plain)
    assert _packed(packed)
    assert torch.equal(packed.model.lm_head.weight(), packed.model.embed_tokens.weight)
    for (decoded, verified), (ref_decoded, ref_verified) in [
        (_decode_and_verify_logits(packed), _decode_and_verify_logits(plain))
    ]:
        torch.testing.assert_close(decoded, ref_decoded, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(verified, ref_verified, atol=1e-4, rtol=1e-4)


def test_auto_leaves_small_models_on_torch_without_measuring(tiny_models, monkeypatch):
    def refuse(*_):
        raise AssertionError("a tiny model must not be measured")

    monkeypatch.setattr(dense_choice, "probe", refuse)
    assert not _packed(_runner(tiny_models["llama"], "auto"))


@pytest.mark.parametrize("verdict", [True, False])
def test_auto_follows_the_measured_verdict(tiny_models, cpu_ops, monkeypatch, tmp_path, verdict):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dense_choice, "MIN_PROBED_WEIGHTS", 0)
    calls = []

    def fake_probe(shapes, dtype):
        calls.append(dict(shapes))
        return {"packed": verdict, "ours_over_torch": [0.5, 0.5]}

    monkeypatch.setattr(dense_choice, "probe", fake_probe)
    assert _packed(_runner(tiny_models["llama"], "auto")) is verdict
    assert _packed(_runner(tiny_models["llama"], "auto")) is verdict  # from the cache
    assert len(calls) == 1 and calls[0]  # measured once, on the model's shapes
    table = json.loads((tmp_path / "dense_choice.json").read_text())
    assert [entry["packed"] for entry in table.values()] == [verdict]


def test_the_cache_is_keyed_and_survives_a_corrupt_table(tmp_path):
    path = tmp_path / "dense_choice.json"
    calls = []

    def measure(answer):
        return lambda: calls.append(answer) or {"packed": answer}

    assert dense_choice.cached_choice("a", measure(True), path) is True
    assert dense_choice.cached_choice("a", measure(False), path) is True  # cached
    assert dense_choice.cached_choice("b", measure(False), path) is False  # another key
    assert calls == [True, False]
    for corrupt in ("[1, 2]", '{"a": 3, "b": {"no": 1}}', "not json"):
        path.write_text(corrupt)
        assert dense_choice.cached_choice("a", measure(False), path) is False
    assert dense_choice.probe_key({(8, 4): 1}, torch.float32) != dense_choice.probe_key(
        {(8, 4): 1}, torch.bfloat16
    )


def test_the_probe_measures_both_kernels_and_applies_its_thresholds(cpu_ops):
    result = dense_choice.probe({(256, 128): 2, (64, 128): 1}, torch.float32)
    decode, prefill = result["ours_over_torch"]
    assert result["rows"] == list(dense_choice.PROBE_ROWS) and decode > 0 and prefill > 0
    expected = decode <= dense_choice.DECODE_WIN and prefill <= dense_choice.PREFILL_WIN
    assert result["packed"] is expected


def test_a_bad_choice_names_the_flag(tiny_models):
    with pytest.raises(ValueError, match="--cpu-dense-kernel must be one of auto, packed, torch"):
        _runner(tiny_models["llama"], "fast")
