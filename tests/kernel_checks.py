"""What kernel tests check beside exact bits: fp32's rounding bound against an fp64
product, and thread counts (the suite's workers run one thread each: conftest.py)."""

from __future__ import annotations

import contextlib

import torch


def assert_within_fp32_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """`got` = x @ weight.T computed in fp32 in any order: each entry within fp32's rounding
    bound for its sum (K * eps * sum |x w|) of the fp64 product. Kernels and BLAS vendors
    block their sums differently, so bits are not compared; a wrong row, offset or scale is
    off by the size of the sum itself."""
    x, weight = x.double(), weight.double()
    expected = x @ weight.t()
    bound = x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs() @ weight.abs().t())
    excess = (got.double() - expected).abs() - bound
    assert (excess <= 0).all(), f"off by {excess.max().item():.3g} past fp32's rounding bound"


@contextlib.contextmanager
def torch_threads(num_threads: int):
    """torch's thread count set to `num_threads` within the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def assert_same_bits_on_one_and_two_threads(fn) -> None:
    """fn() (a kernel call splitting its outputs over torch's threads) gives the same bits on
    one thread and on two. The suite's workers run one thread each (conftest.py), so
    the kernels' thread splits are exercised here."""
    with torch_threads(1):
        one = fn()
    with torch_threads(2):
        assert torch.equal(fn(), one)
