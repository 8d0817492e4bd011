"""Our CPU kernels on each SIMD path, whatever this machine's best one is.

`ATEN_CPU_CAPABILITY=avx2|default` (torch's switch, documented in docs/api.md) lowers the
level torch picks, and our extension's build flags follow it, so a child process under it
builds and runs the AVX2 or the portable code of every kernel of ours. There the kernel and
deterministic-inference tests run again, and the batch-invariant dense matmul must give the
same bits as this process's (best) path: its arithmetic is one fixed FMA chain per output
on every path, and so must the int8-activation matmuls (q8_matmul.py: exact integer dots,
the same fp32 ops in the same lane order on VNNI, AVX2 and portable; repacked Q4_K / Q6_K's
and Q4_0 / Q4_1's 8-row kernels too) and the segmented LoRA op (lora_segments.cpp: one FMA
chain per output, vectors along the outputs)."""

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
    "tests/test_q8_matmul.py",
    "tests/test_dense_panels.py",
    "tests/test_cpu_layer_ops.py",
    "tests/test_moe_cpu_kernel.py",
    "tests/test_lora_segments.py",
    "tests/test_cpu_paged_decode.py",
    "tests/test_deterministic_attention.py",
    "tests/test_cpu_tree_extend.py",
    "tests/test_cpu_softcap.py",
]
LEVELS = {"avx2": "avx2", "default": "portable"}  # ATEN_CPU_CAPABILITY -> our build's path
CASES = [(200, 72, 9), (576, 576, 5), (130, 1100, 17)]  # (N, K, M)

# In the child: every case's dense_mm output under the lowered level, saved beside the inputs.
_DENSE_OUTPUTS = """
import sys, torch
from radixserve.model.quant.batch_invariant import dense_matmul
from radixserve.native.extension import load_cpu_ops
cases, q8_cases, lora_cases = torch.load(sys.argv[1])
ops = load_cpu_ops()
outs = [dense_matmul(x, packed, n) for x, packed, n in cases]
q8_outs = [getattr(ops, op)(*args) for op, args in q8_cases]
for args in lora_cases:
    ops.lora_segments_add(*args)
torch.save({"simd": ops.simd_level(), "int_dot": ops.int_dot_level(), "outs": outs,
            "q8_outs": q8_outs, "lora_outs": [args[0] for args in lora_cases]}, sys.argv[2])
"""
INT_DOT_LEVELS = {"avx2": "avx2", "default": "portable"}


def _child_env(capability: str) -> dict[str, str]:
    return {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": str(ROOT)}


def _skip_without(capability: str) -> None:
    """Skips a lower path this CPU lacks, and one this process runs itself (an AVX2-only
    machine's AVX2 path: the suite itself runs it, and the portable child is compared with
    it)."""
    best = torch.backends.cpu.get_cpu_capability()
    if capability == "avx2" and best not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    if capability == "avx2" and best == "AVX2":
        pytest.skip("this process runs the AVX2 path itself (an AVX2 machine)")


def _q8_cases() -> list[tuple[str, tuple]]:
    """(op name, arguments) of the int8-activation matmuls: every format, block tails."""
    from test_kquant_matmul import random_blocks
    from test_q8_matmul import gguf_int4_blocks

    from radixserve.model.quant.block_matmul import pack_int4_blocks
    from radixserve.model.quant.kquant import KQUANT_TYPES, X8_TYPE
    from radixserve.model.quant.q8_matmul import Q4_0_X8, Q4_1_X8

    gen = torch.Generator().manual_seed(11)
    n, k = 37, 352  # 11 blocks of 32: a group of 8 and a tail of 3
    x = torch.randn(5, k, generator=gen)
    codes = pack_int4_blocks(torch.randint(0, 16, (n, k), generator=gen))
    scale_min = torch.randn(n, k // 32, 2, generator=gen) * 0.05
    qs = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.randn(n, k // 32, generator=gen) * 0.01
    cases = [("int4_block_mm_q8", (x, codes, scale_min)), ("int8_block_mm_q8", (x, qs, scales))]
    xk = torch.randn(6, 768, generator=gen)  # 3 super-blocks: a pair and a tail
    blocks = {}
    for name, (qtype, _) in KQUANT_TYPES.items():
        blocks[name] = torch.from_numpy(random_blocks(n, 768, name, seed=qtype))
        cases.append(("kquant_mm_q8", (xk, blocks[name], qtype)))
    # Q4_K / Q6_K repacked 8 rows at a time (4 groups and a tail of 5): the AVX-512 8-row
    # kernels here, the lower paths unpack the groups for the row kernels
    for name in ("Q4_K", "Q6_K"):
        qtype = KQUANT_TYPES[name][0]
        repacked = torch.ops.radixserve_cpu.kquant_repack_x8(blocks[name], qtype)
        cases.append(("kquant_mm_q8", (xk, repacked, qtype + X8_TYPE)))
    # Q4_0 / Q4_1 repacked (fp16 scales; 11 blocks: chunks of 4, 4 and 3): likewise
    for qtype in (Q4_0_X8, Q4_1_X8):
        repacked = torch.ops.radixserve_cpu.int4_repack_x8(*gguf_int4_blocks(n, k, qtype, 3), qtype)
        cases.append(("int4_x8_mm_q8", (x, repacked, qtype)))
    return cases


def _lora_cases() -> list[tuple[torch.Tensor, ...]]:
    """lora_segments_add's arguments (out first): ranks 16 and 32, 37 outputs (a tail)."""
    import numpy as np

    from radixserve.forward_batch import LoraBatch
    from radixserve.model.lora_segments import stack_slots

    gen = torch.Generator().manual_seed(5)
    weights = {s: (torch.randn(r, 70, generator=gen), torch.randn(37, r, generator=gen))
               for s, r in ((0, 12), (1, 32))}  # fmt: skip
    stacked = stack_slots(weights)
    batch = LoraBatch.build(np.array([0, 1, -1, 1, 0, 1, 1]), "cpu")
    x, out = torch.randn(7, 70, generator=gen), torch.randn(7, 37, generator=gen)
    return [(out, x, batch.rows, batch.offsets, batch.slot_ids, stacked.ranks, stacked.at,
             stacked.bt)]  # fmt: skip


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
def test_dense_and_q8_matmuls_give_the_same_bits_on_every_path(cpu_ops, capability, tmp_path):
    _skip_without(capability)
    cases, q8_cases, lora_cases = _cases(), _q8_cases(), _lora_cases()
    torch.save((cases, q8_cases, lora_cases), tmp_path / "cases.pt")
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
    assert child["int_dot"] == INT_DOT_LEVELS[capability]
    for (op, args), out in zip(q8_cases, child["q8_outs"]):
        assert torch.equal(getattr(cpu_ops, op)(*args), out), (op, cpu_ops.int_dot_level())
    for args, out in zip(lora_cases, child["lora_outs"]):
        cpu_ops.lora_segments_add(*args)
        assert torch.equal(args[0], out)
