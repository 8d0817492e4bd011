"""Our CPU kernels on each SIMD path, whatever this machine's best one is.

`ATEN_CPU_CAPABILITY=avx2|default` (torch's switch, documented in docs/api.md) lowers the
level torch picks, and our extension's build flags follow it, so a child process under it
builds and runs the AVX2 or the portable code of every kernel of ours. There the kernel and
deterministic-inference tests run again, and the batch-invariant dense matmul must give the
same bits as this process's (best) path: its arithmetic is one fixed FMA chain per output
on every path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.model.quant.batch_invariant import dense_matmul, pack_dense_weight

ROOT = Path(__file__).parent.parent
KERNEL_TESTS = [
    "tests/test_dense_matmul.py",
    "tests/test_batch_invariance.py",
    "tests/test_block_matmul.py",
    "tests/test_kquant_matmul.py",
    "tests/test_cpu_layer_ops.py",
    "tests/test_cpu_paged_decode.py",
    "tests/test_deterministic_attention.py",
]
LEVELS = {"avx2": "avx2", "default": "portable"}  # ATEN_CPU_CAPABILITY -> our build's path
CASES = [(200, 72, 9), (576, 576, 5), (130, 1100, 17)]  # (N, K, M)

# In the child: every case's dense_mm output under the lowered level, saved beside the inputs.
_DENSE_OUTPUTS = """
import sys, torch
from radixserve.model.quant.batch_invariant import dense_matmul
from radixserve.native.extension import load_cpu_ops
cases = torch.load(sys.argv[1])
ops = load_cpu_ops()
outs = [dense_matmul(x, packed, n) for x, packed, n in cases]
torch.save({"simd": ops.simd_level(), "outs": outs}, sys.argv[2])
"""


def _child_env(capability: str) -> dict[str, str]:
    return {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": str(ROOT)}


def _skip_without(capability: str) -> None:
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")


def _cases() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    gen = torch.Generator().manual_seed(7)
    cases = []
    for n, k, m in CASES:
        for x_dtype in (torch.float32, torch.bfloat16):
            for w_dtype in (torch.float32, torch.bfloat16):
                weight = (torch.randn(n, k, generator=gen) / k**0.5).to(w_dtype)
                x = torch.randn(m, k, generator=gen).to(x_dtype)
                cases.append((x, pack_dense_weight(weight), n))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("capability", list(LEVELS))
def test_kernel_and_deterministic_tests_pass_on_the_lower_path(cpu_ops, capability):
    _skip_without(capability)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-m",
        "not slow",
        "-p",
        "no:cacheprovider",
        *KERNEL_TESTS,
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=_child_env(capability), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.mark.parametrize("capability", list(LEVELS))
def test_dense_matmul_gives_the_same_bits_on_every_path(cpu_ops, capability, tmp_path):
    _skip_without(capability)
    cases = _cases()
    torch.save(cases, tmp_path / "cases.pt")
    command = [
        sys.executable,
        "-c",
        _DENSE_OUTPUTS,
        str(tmp_path / "cases.pt"),
        str(tmp_path / "outs.pt"),
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=_child_env(capability), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    child = torch.load(tmp_path / "outs.pt")
    assert child["simd"] == LEVELS[capability]  # the switch reached every kernel file
    assert cpu_ops.simd_level() != LEVELS[capability]  # this process: a different path
    for (x, packed, n), out in zip(cases, child["outs"]):
        assert torch.equal(dense_matmul(x, packed, n), out), (tuple(x.shape), x.dtype, n)
