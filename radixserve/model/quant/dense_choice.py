"""Which matmul runs a CPU model's fp projections and LM head: torch's or our packed kernel.

torch's fp32 / bf16 matmul is whatever BLAS it ships (MKL, oneDNN), and how fast that is
depends on the vendor of the CPU as much as on its SIMD level: on an AMD EPYC with AVX-512,
MKL's fp32 GEMM runs at about half the speed of our own dense kernel
(native/csrc/dense_matmul.cpp, the one --enable-deterministic-inference uses), on an Intel
Xeon at about the same speed for one row and faster for prefill. So `--cpu-dense-kernel auto`
measures, once per machine: both kernels on the model's distinct projection shapes, at one
row (a decode step) and at a prefill chunk, and packs the fp layers into our kernel's layout
(`BatchInvariantLinear`) only where ours is clearly faster at both. The answer is cached in
<cache_root>/dense_choice.json, keyed by CPU, SIMD level, torch version, thread count, dtype
and shapes, so every process on the machine takes the same path (a file lock keeps two
processes from measuring at once), and it never changes within a process.

Models whose largest layer is small (tests' tiny models) are not measured: they keep torch's,
where the choice could only follow noise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.disk_cache import cache_root, exclusive
from radixserve.model.quant import QuantizationError
from radixserve.model.quant.base_linear import UnquantizedLinear
from radixserve.model.quant.batch_invariant import dense_kernels, dense_matmul, pack_dense_weight

logger = logging.getLogger(__name__)

CPU_DENSE_KERNELS = ("auto", "packed", "torch")
MIN_PROBED_WEIGHTS = 4_000_000
"""Weights (N x K) the largest fp layer must have before `auto` measures at all."""
PROBE_ROWS = (1, 128)  # a decode step, a prefill chunk
DECODE_WIN = 0.8  # ours must take at most this fraction of torch's time at one row
PREFILL_WIN = 1.0  # ... and no more than torch's at the prefill chunk
PROBE_REPEATS = 5
PROBE_VERSION = 2  # part of the cache key: a change to how the probe measures re-measures


def check_cpu_dense_kernel(choice: str) -> None:
    if choice not in CPU_DENSE_KERNELS:
        allowed = ", ".join(CPU_DENSE_KERNELS)
        raise QuantizationError(f"--cpu-dense-kernel must be one of {allowed}; got {choice!r}")


def fp_layer_shapes(model: nn.Module) -> Counter[tuple[int, int]]:
    """(out, in) of every fp projection and of the LM head (a tied head: the embedding's),
    with how many layers have it."""
    shapes: Counter[tuple[int, int]] = Counter(
        (m.out_features, m.in_features) for m in model.modules() if isinstance(m, UnquantizedLinear)
    )
    if getattr(model, "lm_head", False) is None:  # tied: the embedding is the head
        shapes[tuple(model.head_weight().shape)] += 1
    return shapes


def use_packed_dense(model: nn.Module, choice: str, dtype: torch.dtype) -> bool:
    """--cpu-dense-kernel -> whether the fp layers of this CPU model go to our kernel."""
    check_cpu_dense_kernel(choice)
    if choice == "torch":
        return False
    if dense_kernels() is None:
        if choice == "packed":
            raise QuantizationError(
                "--cpu-dense-kernel packed: the C++ dense kernel did not build here"
            )
        return False
    if choice == "packed":
        return True
    shapes = fp_layer_shapes(model)
    if not shapes or max(n * k for n, k in shapes) < MIN_PROBED_WEIGHTS:
        return False
    return cached_choice(probe_key(shapes, dtype), lambda: probe(shapes, dtype))


def probe_key(shapes: Counter[tuple[int, int]], dtype: torch.dtype) -> str:
    """What the measurement depends on: the machine, torch, threads, dtype and the shapes."""
    from radixserve.native.machine import describe_cpu

    text = json.dumps(
        [
            PROBE_VERSION,
            describe_cpu(),
            torch.__version__,
            torch.get_num_threads(),
            str(dtype),
            sorted(shapes.items()),
        ]  # fmt: skip
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_choice(key: str, measure: Callable[[], dict], path: Path | None = None) -> bool:
    """The cached answer for `key`, measuring (under a file lock) and storing it when absent."""
    path = path or cache_root() / "dense_choice.json"
    return bool(cached_measurement(key, measure, path, required="packed")["packed"])


def cached_measurement(key: str, measure: Callable[[], dict], path: Path, required: str) -> dict:
    """The measurement stored under `key` in the JSON table at `path`, measured (under a file
    lock, so that two processes never measure at once) and stored when absent; entries
    without the `required` field are dropped as unreadable. Shared by the kernel choices."""
    with exclusive(path.with_suffix(".lock")):
        table = _read_table(path, required)
        if key not in table:
            table[key] = measure()
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
            logger.info("kernel choice measured (%s): %s", path.name, table[key])
    return table[key]


def _read_table(path: Path, required: str) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {k: v for k, v in table.items() if isinstance(v, dict) and required in v}


def probe(shapes: Counter[tuple[int, int]], dtype: torch.dtype) -> dict:
    """Seconds per forward of every fp layer, torch vs ours, at each of PROBE_ROWS rows, and
    the verdict: packed when ours wins by DECODE_WIN at one row and PREFILL_WIN at a chunk."""
    seconds = {"torch": [0.0] * len(PROBE_ROWS), "ours": [0.0] * len(PROBE_ROWS)}
    gen = torch.Generator().manual_seed(0)
    for (n, k), count in shapes.items():
        weight = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
        packed = pack_dense_weight(weight)
        for i, rows in enumerate(PROBE_ROWS):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            torch_s, ours_s = best_times(
                partial(F.linear, x, weight), partial(dense_matmul, x, packed, n)
            )
            seconds["torch"][i] += count * torch_s
            seconds["ours"][i] += count * ours_s
    ratios = [ours / max(torch_s, 1e-9) for ours, torch_s in zip(seconds["ours"], seconds["torch"])]
    packed = ratios[0] <= DECODE_WIN and ratios[1] <= PREFILL_WIN
    return {"packed": packed, "rows": list(PROBE_ROWS), "ours_over_torch": ratios}


def best_times(
    *calls: Callable[[], torch.Tensor],
    repeats: int = PROBE_REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """The fastest of `repeats` runs of each call by `clock`, the calls taking turns (a busy
    moment of a shared machine slows them alike rather than one of them)."""
    for call in calls:
        call()  # warm-up: first-touch pages, thread pool start
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = clock()
            call()
            best[i] = min(best[i], clock() - start)
    return best
