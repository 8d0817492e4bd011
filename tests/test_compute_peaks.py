"""benchmarks/compute_peaks.py: the compute roofline's fp32 peak is never below what
radixserve's own dense kernel reaches (torch's MKL GEMM takes its AVX2 path on AMD CPUs)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compute_peaks  # noqa: E402


def test_dense_kernel_rate_is_measured():
    rate = compute_peaks._dense_kernel_rate(1)
    assert rate > 1e9  # operations per second: any machine's C++ kernel does > 1 GFLOP/s


def test_fp32_peak_is_the_larger_of_torch_and_the_dense_kernel(monkeypatch):
    monkeypatch.setattr(compute_peaks, "_dense_kernel_rate", lambda repeats: 4e15)
    assert compute_peaks.compute_peaks(1)["fp32"] == 4e6  # GFLOP/s: the kernel's, not torch's
    monkeypatch.setattr(compute_peaks, "_dense_kernel_rate", lambda repeats: 0.0)
    torch_only = compute_peaks.compute_peaks(1)["fp32"]
    assert 0 < torch_only < 4e6
