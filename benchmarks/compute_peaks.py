"""Peak arithmetic rates of this CPU as torch's GEMMs reach them, for the compute roofline.

Each rate: a square GEMM small enough to stay in cache (SIZE x SIZE operands) run back to
back, 2 * SIZE^3 operations per call over the median call time: fp32 FMA (torch.mm on fp32),
bf16 dot (torch.mm on bf16: oneDNN's AVX512-BF16 or AMX where present) and int8 dot
(torch._int_mm: VNNI / AMX-INT8). A rate torch cannot run here is left out. These are what a
well-tuned kernel reaches, not the datasheet's peak: a decode step near them is compute-bound.

The fp32 rate is the larger of torch.mm's and radixserve's own AVX-512 dense kernel's (the
one decode steps run, on a packed weight, 64 rows): torch's fp32 GEMM is MKL's, which takes
its AVX2 path on AMD CPUs (~100 GFLOP/s on an EPYC whose AVX-512 FMAs reach ~215), and a
bound below what a kernel reaches would be no bound.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

SIZE = 512
CALLS = 20


def _rate(call: Callable[[], object], repeats: int) -> float:
    """Operations per second of `call` (2 * SIZE^3 each), median of `repeats` timed batches."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        times.append((time.perf_counter() - start) / CALLS)
    return 2 * SIZE**3 / statistics.median(times)


def _dense_kernel_rate(repeats: int) -> float:
    """fp32 FMA rate of radixserve's dense_mm (x [64, SIZE] @ a packed [SIZE, SIZE] weight,
    scaled to 2 * SIZE^3 a call); 0 where the C++ kernels do not build."""
    from radixserve.model.quant.batch_invariant import dense_matmul, pack_dense_weight
    from radixserve.native.extension import CpuExtensionUnavailable, load_cpu_ops

    try:
        load_cpu_ops()
    except CpuExtensionUnavailable:
        return 0.0
    gen = torch.Generator().manual_seed(1)
    rows = 64
    x = torch.randn(rows, SIZE, generator=gen)
    packed = pack_dense_weight(torch.randn(SIZE, SIZE, generator=gen))
    return _rate(lambda: dense_matmul(x, packed, SIZE), repeats) * rows / SIZE


def compute_peaks(repeats: int = 5) -> dict[str, float]:
    """GFLOP/s (GOP/s for int8) of each arithmetic: 'fp32', 'bf16', 'int8'."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(SIZE, SIZE, generator=gen), torch.randn(SIZE, SIZE, generator=gen)
    peaks = {"fp32": max(_rate(lambda: torch.mm(a, b), repeats), _dense_kernel_rate(repeats))}
    a16, b16 = a.bfloat16(), b.bfloat16()
    peaks["bf16"] = _rate(lambda: torch.mm(a16, b16), repeats)
    a8 = torch.randint(-127, 128, (SIZE, SIZE), dtype=torch.int8, generator=gen)
    b8 = torch.randint(-127, 128, (SIZE, SIZE), dtype=torch.int8, generator=gen)
    try:
        peaks["int8"] = _rate(lambda: torch._int_mm(a8, b8), repeats)
    except (RuntimeError, AttributeError):  # no int8 GEMM in this torch build
        pass
    return {name: rate / 1e9 for name, rate in peaks.items()}


if __name__ == "__main__":
    for name, rate in compute_peaks().items():
        print(f"{name}: {rate:.1f} G/s ({torch.get_num_threads()} threads)")
