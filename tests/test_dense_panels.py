"""Prefill's dense matmul on the block kernels' layers (dense_panels.py): the weight goes
through in panels of rows dequantized by the C++ ops into one reused buffer, and the result
is the whole dequantized weight's matmul; the dtype of that matmul is measured per machine
(activation_choice.configure_dense_dtype)."""

from __future__ import annotations

import threading

import pytest
import torch
from kernel_checks import assert_within_fp32_rounding
from test_kquant_matmul import random_blocks
from torch import nn

from radixserve.model.quant import activation_choice, dense_panels
from radixserve.model.quant.kquant import KQuantLinear
from radixserve.model.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear


def _layers(out: int, k: int) -> list:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (out, k), generator=gen)
    scales, zeros = torch.rand(out, k // 32, generator=gen) * 0.1, torch.randn(out, k // 32) * 0.1
    q8 = torch.randint(-127, 128, (out, k), generator=gen, dtype=torch.int8)
    blocks = torch.from_numpy(random_blocks(out, k, "Q6_K", seed=3))
    order = torch.randperm(out, generator=gen)  # llama.cpp's permuted q / k rows
    return [
        Int4WeightOnlyLinear(codes, scales, zeros, 32, backend="blocks"),
        Int8WeightOnlyLinear(q8, scales, group_size=32, backend="blocks"),
        KQuantLinear(blocks, "Q6_K"),
        KQuantLinear(blocks, "Q6_K", row_order=order),
    ]


def test_panels_give_the_whole_weights_matmul_however_the_rows_split(cpu_ops, monkeypatch):
    # 512 inputs: a panel of 16 rows is 32 KiB, so 40 KiB panels take 16 rows at a time and
    # the 72 outputs end on a short panel
    monkeypatch.setattr(dense_panels, "PANEL_BYTES", 40 << 10)
    assert dense_panels.panel_rows(72, 512) == 16
    x = torch.randn(130, 512)
    for layer in _layers(72, 512):
        layer.dense_dtype = torch.float32
        assert layer._panel_source() is not None
        got = layer(x)  # 130 rows >= dequant_min_rows: the dense path
        # a panel's GEMM may block its sums unlike the whole weight's (BLAS picks kernels by
        # shape, per vendor): within fp32's rounding bound of the fp64 product, not bits
        assert_within_fp32_rounding(got, x, layer.dequantize(torch.float32))


def test_bf16_panels_give_the_bf16_matmul_of_the_weights_values(cpu_ops, monkeypatch):
    """dense_dtype bf16: x and each panel rounded to bf16 (as the whole weight was), the
    product within a bf16 rounding of the output; the panels' buffers are reused."""
    monkeypatch.setattr(dense_panels, "PANEL_BYTES", 40 << 10)
    monkeypatch.setattr(dense_panels, "_local", threading.local())  # buffers made below
    x = torch.randn(130, 512)
    with torch.inference_mode():  # as serving runs; the buffers then serve calls outside it
        dense_panels.panel_matmul(x, 16, lambda row0, out: out.zero_(), torch.bfloat16)
    for layer in _layers(72, 512):
        layer.dense_dtype = torch.bfloat16
        got = layer(x)
        weight = layer.dequantize(torch.float32).bfloat16().double()
        want = x.bfloat16().double() @ weight.t()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max())
        assert torch.equal(got, got.bfloat16().float())  # a bf16 GEMM's output
        layer.dense_dtype = torch.float32
        assert not torch.equal(layer(x), got)
    buffers = [dense_panels._scratch(16, 512, dtype) for dtype in (torch.float32, torch.bfloat16)]
    assert buffers[1].dtype == torch.bfloat16 and buffers[0].data_ptr() != buffers[1].data_ptr()
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16"):
        dense_panels.panel_matmul(x, 72, lambda row0, out: None, torch.float16)


def test_panel_ops_write_bf16_as_the_fp32_panel_rounds(cpu_ops):
    """A bf16 panel from the C++ op holds the fp32 panel's values rounded to nearest even,
    bit for bit what torch's cast gives (ties and values past bf16's precision included)."""
    for layer in _layers(72, 512):
        into, _ = layer._panel_source()
        fp32, bf16 = torch.empty(40, 512), torch.empty(40, 512, dtype=torch.bfloat16)
        into(24, fp32)
        into(24, bf16)
        assert torch.equal(bf16, fp32.bfloat16())
        assert not torch.equal(bf16.float(), fp32)  # the rounding happened
    ties = torch.full((16, 1), 1 + 3 * 2**-8).expand(16, 2).contiguous()  # halfway: bf16 ties
    q8 = torch.tensor([1, 3, -1, 5], dtype=torch.int8).repeat(16, 16)
    into, _ = Int8WeightOnlyLinear(q8, ties, group_size=32, backend="blocks")._panel_source()
    fp32, bf16 = torch.empty(16, 64), torch.empty(16, 64, dtype=torch.bfloat16)
    into(0, fp32)
    into(0, bf16)
    assert torch.equal(bf16, fp32.bfloat16()) and bf16[0, 0].item() == 1 + 2**-6  # up, to even
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        into(0, torch.empty(8, 512, dtype=torch.float16))


def test_panel_ops_refuse_rows_past_the_weight(cpu_ops):
    layer = _layers(32, 256)[2]
    into, _ = layer._panel_source()
    try:
        into(20, torch.empty(16, 256))
    except RuntimeError as exc:
        assert "exceed the weight's 32" in str(exc)
    else:
        raise AssertionError("rows past the weight were accepted")


class _Model(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.proj = layer


def test_the_prefill_dtype_is_measured_for_large_models_only(cpu_ops, monkeypatch, tmp_path):
    calls = []

    def fake_probe():
        calls.append(1)
        return {"dtype": "float32"}

    monkeypatch.setattr(activation_choice, "probe_dense_dtype", fake_probe)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    big = KQuantLinear(torch.zeros(2048, 2048 // 256 * 144, dtype=torch.uint8), "Q4_K")
    small = KQuantLinear(torch.zeros(64, 144, dtype=torch.uint8), "Q4_K")
    for layer in (big, small):
        layer.dense_dtype = torch.bfloat16
        activation_choice.configure_dense_dtype(_Model(layer), torch.bfloat16)
    assert big.dense_dtype == torch.float32  # measured: fp32 won
    assert small.dense_dtype == torch.bfloat16  # too small to measure: the default kept
    activation_choice.configure_dense_dtype(_Model(big), torch.bfloat16)
    assert len(calls) == 1  # the verdict is cached for the machine


def test_the_probe_times_both_dtypes():
    entry = activation_choice.probe_dense_dtype()
    assert entry["dtype"] in ("float32", "bfloat16")
    assert entry["fp32_s"] > 0 and entry["bf16_s"] > 0
    bf16_wins = entry["bf16_s"] <= activation_choice.BF16_WIN * entry["fp32_s"]
    assert (entry["dtype"] == "bfloat16") == bf16_wins
