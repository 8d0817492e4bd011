"""The C++ small-M matmul over GGUF-style weight blocks on CPU (backend "blocks").

A block is 32 inputs of one output row; its weights are dequantized to fp32 once and
multiplied into every activation row with fp32 FMAs (native/csrc/block_matmul.cpp), so the
result is the dequantized matmul up to fp32 summation order, and a row's result does not
depend on how many rows share the call (--enable-deterministic-inference may use it).

    layout  codes                               per block
    int4    qs [N, K / 2] uint8, GGUF order:    scale_min [N, K / 32, 2] fp32: w = q * d + m
            byte j = element j | element j + 16
    int8    qs [N, K] int8                      scales [N, K / 32] fp32: w = q * d

With int8 activations (q8_matmul.py, chosen by activation_choice.py) the same blocks meet
activations quantized to int8 blocks in integer dots, as llama.cpp computes them; on AVX-512
and AVX2 builds an int4 layer of a GGUF Q4_0 / Q4_1 then takes its rows 8 at a time, with
fp16 scales (`int4_x8_type`, Int4WeightOnlyLinear.repack_rows8: the same bits).

Chosen at load time (`--cpu-quant-kernel`, `resolve_cpu_quant_kernel`): only where the
extension builds with AVX2 or AVX512 intrinsics; its portable build is correct but slower
than torch's kernels, which then stay.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from radixserve.model.quant import q8_matmul

logger = logging.getLogger(__name__)

BLOCK = 32  # inputs per block (GGUF's Q4_0 / Q4_1 / Q8_0)
CPU_QUANT_KERNELS = ("auto", "blocks", "torch")


@functools.cache
def block_kernels() -> Any | None:
    """`torch.ops.radixserve_cpu` if its block matmuls were built with SIMD here, else None."""
    from radixserve.native.extension import CpuExtensionUnavailable, load_cpu_ops

    try:
        ops = load_cpu_ops()
    except CpuExtensionUnavailable as exc:
        logger.info("block matmul kernels unavailable, torch's int kernels run: %s", exc)
        return None
    simd = ops.simd_level()
    if simd == "portable":
        logger.info("block matmul kernels built without AVX2 / AVX512; torch's kernels run")
        return None
    return ops


def resolve_cpu_quant_kernel(choice: str) -> str:
    """--cpu-quant-kernel -> the backend GGUF int4 / int8 layers use on CPU: "blocks" or
    "torch". `auto` takes blocks where they are available; `blocks` insists on them."""
    if choice not in CPU_QUANT_KERNELS:
        allowed = ", ".join(CPU_QUANT_KERNELS)
        raise ValueError(f"--cpu-quant-kernel must be one of {allowed}; got {choice!r}")
    if choice == "torch":
        return "torch"
    if block_kernels() is not None:
        return "blocks"
    if choice == "blocks":
        raise ValueError(
            "--cpu-quant-kernel blocks: the C++ block kernels did not build with AVX2 / AVX512 "
            "here (see the log); use auto or torch"
        )
    return "torch"


def quantized_int4_backend(choice: str, group_size: int) -> str | None:
    """The backend of a CPU int4 layer quantized on load (--quantization int4): groups of 32
    (a GGUF Q4_1 block's shape) take the block kernels as gguf's layers do, by
    --cpu-quant-kernel; None (torch's kernel) for other sizes."""
    return resolve_cpu_quant_kernel(choice) if group_size == BLOCK else None


def pack_int4_blocks(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K / 2] uint8 in GGUF's nibble order."""
    n, k = codes.shape
    low, high = codes.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2).unbind(2)
    return (low | (high << 4)).reshape(n, k // 2).contiguous()


def unpack_int4_blocks(qs: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] uint8 in GGUF's nibble order -> [N, K] uint8 codes 0..15."""
    n, half = qs.shape
    blocks = qs.reshape(n, half * 2 // BLOCK, BLOCK // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, half * 2)


def int4_x8_type(scale_min: torch.Tensor) -> int | None:
    """The repacked type int4 blocks take (q8_int4_x8.h): Q4_0_X8 where every scale is an fp16
    value and every offset -8 x its scale (a GGUF Q4_0's), Q4_1_X8 where scales and offsets
    are fp16 values (a GGUF Q4_1's), else None (the repacked bytes keep fp16 only)."""
    scales, offsets = scale_min.unbind(-1)
    if not torch.equal(scales.half().float(), scales):
        return None
    if torch.equal(offsets, 0 - 8 * scales):
        return q8_matmul.Q4_0_X8
    return q8_matmul.Q4_1_X8 if torch.equal(offsets.half().float(), offsets) else None


def int4_block_matmul(
    x: torch.Tensor, qs: torch.Tensor, scale_min: torch.Tensor, int8_activations: bool = False
) -> torch.Tensor:
    """[M, K] fp32 / bf16 @ int4 blocks.T -> [M, N] in x's dtype (fp32 arithmetic; with
    int8_activations, q8_matmul.py's integer dots). The ops are called through torch.ops (what
    torch.compile traces); `load_block_ops` comes first."""
    if int8_activations:
        return q8_matmul.int4_block_matmul_q8(x, qs, scale_min)
    return torch.ops.radixserve_cpu.int4_block_mm(x.contiguous(), qs, scale_min)


def int8_block_matmul(
    x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, int8_activations: bool = False
) -> torch.Tensor:
    """[M, K] fp32 / bf16 @ int8 blocks.T -> [M, N] in x's dtype (fp32 arithmetic, or with
    int8_activations integer dots)."""
    if int8_activations:
        return q8_matmul.int8_block_matmul_q8(x, qs, scales)
    return torch.ops.radixserve_cpu.int8_block_mm(x.contiguous(), qs, scales)


@functools.cache
def load_block_ops() -> None:
    """Loads the extension whatever its SIMD level (a layer built with backend "blocks" runs
    it) and tells torch.compile's tracer what the ops return without running them."""
    from radixserve.native.extension import load_cpu_ops

    load_cpu_ops()
    q8_matmul.load_q8_ops()

    @torch.library.register_fake("radixserve_cpu::int4_block_mm")
    def _int4_fake(x, qs, scale_min):
        return x.new_empty(x.shape[0], qs.shape[0])

    @torch.library.register_fake("radixserve_cpu::int8_block_mm")
    def _int8_fake(x, qs, scales):
        return x.new_empty(x.shape[0], qs.shape[0])
