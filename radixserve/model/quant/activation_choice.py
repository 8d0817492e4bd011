"""Which activations the GGUF block layers' CPU kernels take, and from how many rows a layer
dequantizes and runs one dense matmul instead (`--cpu-quant-activation`).

    fp32  each 32-weight unit dequantized to fp32, fp32 FMAs (block_matmul.cpp,
          kquant_matmul.cpp): exact to the dequantized weights
    int8  activations quantized per row to q8 blocks, integer dots (q8_matmul.cpp), as
          llama.cpp computes them: ~0.3% of a dot's size away from fp32
    auto  per layer shape, whichever measures faster here, once per machine

`auto` times one real layer of each distinct (format, out, in) of the model: both kernels at
DECODE_ROWS (a decode step alone and a batch of 16; int8 where its time per row averaged over
the two is at most INT8_WIN of fp32's: a near tie stays fp32 rather than follow noise), then
the chosen kernel and the layer's dense path (dequantize + one matmul in its dense dtype, or
the shared fp weight of a tied head) at PREFILL_ROWS. Kernel time is linear in rows and dense
time an intercept plus a slope, so the two cross at one row count: the layer's
`dequant_min_rows` (None where the kernel costs no more per row than the dense matmul; never
below MIN_KERNEL_ROWS). Times are the process's CPU time (every thread's; time descheduled on
a shared machine does not count), best of PROBE_REPEATS. The answers are cached per machine
(CPU, SIMD levels, torch, threads, shapes) by dense_choice.py's table machinery, so every
process takes the same paths and a process never changes them.

A K-quant / Q4_0 / Q4_1 layer on int8 activations then takes its rows 8 at a time
(`repack_int8_layers`: the layers' repack_rows8, where the build runs that layout natively;
the same bits), and the probe times int8 on such a twin of its layer.

Both kernels are row-invariant. Under --enable-deterministic-inference (every row count on the
kernels), `auto` takes fp32 (exact to the dequantized weights, no timing-dependent path);
`int8` there puts every row count on the int8 kernel. Models whose largest block projection
(the LM head aside) is under MIN_PROBED_WEIGHTS (the default SmolLM2-135M, tests' tiny
models) are not measured: fp32 and the fixed thresholds, as before this flag. On the default
model int8 would win on speed (1.5x a decode step on a Zen 4 with VNNI) at a cost: +0.29%
perplexity through the kernels, another argmax at 3% of positions, greedy answers that leave
fp32's within a few dozen tokens (as llama-server's, the same arithmetic, do; see
docs/performance.md, "The default model's int8 activations against llama-server's answers"),
so it stays opt-in there.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.disk_cache import cache_root
from radixserve.model.quant import QuantizationError
from radixserve.model.quant.base_linear import DEQUANT_MIN_ROWS, QuantizedLinear
from radixserve.model.quant.dense_choice import MIN_PROBED_WEIGHTS, best_times, cached_measurement
from radixserve.model.quant.kquant import KQuantLinear
from radixserve.model.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

logger = logging.getLogger(__name__)

CPU_QUANT_ACTIVATIONS = ("auto", "fp32", "int8")
DECODE_ROWS = (1, 16)
PREFILL_ROWS = (64, 256)
INT8_WIN = 0.9  # int8 must take at most this fraction of fp32's time per row (noise margin)
MIN_KERNEL_ROWS = DEQUANT_MIN_ROWS
"""Batches below this (decode, verify, short extends) stay on the row-invariant kernels
whatever the fit says: a short extend then rounds as a decode does, as before this flag."""
PROBE_REPEATS = 3
PROBE_VERSION = 6  # part of the cache key: a change to how the probe measures re-measures
# (5: bf16 dense matmuls go panel by panel, dense_panels.py; 6: AVX2 runs repacked K-quants)
TABLE = "quant_activation_choice.json"
DTYPE_TABLE = "prefill_dtype_choice.json"
DTYPE_SHAPE = (256, 2048, 2048)  # rows, out, in: a prefill chunk through a 1B projection
BF16_WIN = 0.9  # bf16 must take at most this fraction of fp32's time (a near tie: fp32)


def check_cpu_quant_activation(choice: str) -> None:
    if choice not in CPU_QUANT_ACTIVATIONS:
        allowed = ", ".join(CPU_QUANT_ACTIVATIONS)
        raise QuantizationError(f"--cpu-quant-activation must be one of {allowed}; got {choice!r}")


def block_layers(model: nn.Module) -> list[QuantizedLinear]:
    """The layers on the GGUF block kernels (K-quants, and int4 / int8 with backend blocks);
    not an untied embedding's table (block_embedding.py: it never runs a matmul)."""
    table = getattr(getattr(model, "embed_tokens", None), "table", None)
    lookup_only = table if table is not getattr(model, "lm_head", None) else None
    int_layers = (Int4WeightOnlyLinear, Int8WeightOnlyLinear)
    return [
        m
        for m in model.modules()
        if m is not lookup_only
        and (isinstance(m, KQuantLinear) or (isinstance(m, int_layers) and m.backend == "blocks"))
    ]


def layer_kind(layer: QuantizedLinear) -> str:
    """E.g. 'Q6_K 49152x2048 tied': format, out x in, and whether its dense path is shared."""
    fmt = getattr(layer, "type_name", None) or type(layer).__name__.removesuffix("WeightOnlyLinear")
    tied = " tied" if layer._shared_dense is not None else ""
    return f"{fmt} {layer.out_features}x{layer.in_features}{tied}"


def configure_block_activations(model: nn.Module, choice: str, deterministic: bool) -> None:
    """--cpu-quant-activation -> every block layer's `int8_activations` (and, measured,
    `dequant_min_rows`)."""
    check_cpu_quant_activation(choice)
    layers = block_layers(model)
    if not layers or choice == "fp32" or (choice == "auto" and deterministic):
        return
    if choice == "int8":
        for layer in layers:
            layer.int8_activations = True
        repack_int8_layers(layers)
        return
    head = getattr(model, "lm_head", None)
    projections = [layer.out_features * layer.in_features for layer in layers if layer is not head]
    if max(projections, default=0) < MIN_PROBED_WEIGHTS:
        return
    kinds = {layer_kind(layer): layer for layer in layers}  # one representative per kind
    path = cache_root() / TABLE
    table = cached_measurement(probe_key(kinds), partial(probe, kinds), path, required="kinds")
    apply_choice(layers, table["kinds"])
    repack_int8_layers(layers)


REPACKABLE = (KQuantLinear, Int4WeightOnlyLinear)  # the layers with repack_rows8


def repack_int8_layers(layers: list[QuantizedLinear]) -> None:
    """The K-quant / Q4_0 / Q4_1 layers on int8 activations -> rows 8 at a time where this
    build runs that layout natively (a tied head's embedding lookups then dequantize its rows
    from it)."""
    repacked = [
        layer
        for layer in layers
        if isinstance(layer, REPACKABLE) and layer.int8_activations and layer.can_repack()
    ]
    for layer in repacked:
        layer.repack_rows8()
    if repacked:
        logger.info("int8 activations: %d block layers repacked 8 rows at a time", len(repacked))


def configure_dense_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """The block layers' prefill matmul dtype (`dense_dtype`): `dtype`, except that bf16 (the
    CPU default under an fp32 model) becomes fp32 where a bf16 GEMM measures slower here
    (no AVX512-BF16 / AMX, e.g. Ice Lake or AVX2 machines: 3-4x slower; with them several
    times faster). Models under MIN_PROBED_WEIGHTS keep `dtype` unmeasured."""
    layers = [layer for layer in block_layers(model) if layer.compute_dtype is None]
    if dtype != torch.bfloat16 or not layers:
        return
    if max(layer.out_features * layer.in_features for layer in layers) < MIN_PROBED_WEIGHTS:
        return
    chosen = prefill_dense_dtype()
    for layer in layers:
        layer.dense_dtype = chosen


def prefill_dense_dtype() -> torch.dtype:
    """bf16 or fp32, whichever runs a prefill chunk's dense matmul faster on this machine
    (measured once, cached by machine, torch and threads)."""
    from radixserve.native.machine import describe_cpu

    text = json.dumps(
        [PROBE_VERSION, describe_cpu(), torch.__version__, torch.get_num_threads(), DTYPE_SHAPE]
    )
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    entry = cached_measurement(key, probe_dense_dtype, cache_root() / DTYPE_TABLE, required="dtype")
    return torch.bfloat16 if entry["dtype"] == "bfloat16" else torch.float32


def probe_dense_dtype() -> dict:
    """fp32 vs bf16 (the weight cast included, as the dense path casts the dequantized
    weight) at DTYPE_SHAPE, alternated, CPU time; bf16 only when it wins by BF16_WIN."""
    rows, out_features, in_features = DTYPE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.02
    fp32_s, bf16_s = best_times(
        partial(F.linear, x, weight),
        partial(_bf16_linear, x, weight),
        repeats=PROBE_REPEATS,
        clock=time.process_time,
    )
    dtype = "bfloat16" if bf16_s <= BF16_WIN * fp32_s else "float32"
    return {"dtype": dtype, "shape": list(DTYPE_SHAPE), "fp32_s": fp32_s, "bf16_s": bf16_s}


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()


def apply_choice(layers: list[QuantizedLinear], kinds: dict[str, dict]) -> None:
    for layer in layers:
        entry = kinds[layer_kind(layer)]
        layer.int8_activations = bool(entry["int8"])
        if layer.dequant_min_rows is not None:
            rows = entry["dense_min_rows"]  # floored again: a table of an older floor
            layer.dequant_min_rows = None if rows is None else max(MIN_KERNEL_ROWS, rows)
    chosen = {
        kind: ("int8" if e["int8"] else "fp32", e["dense_min_rows"]) for kind, e in kinds.items()
    }
    logger.info("--cpu-quant-activation auto: (activations, dense from rows) %s", chosen)


def probe_key(kinds: dict[str, QuantizedLinear]) -> str:
    """What the measurement depends on: machine, build, torch, threads and the layer kinds."""
    from radixserve.native.extension import kernels_key, load_cpu_ops
    from radixserve.native.machine import describe_cpu

    ops = load_cpu_ops()
    dense = sorted({str(layer.dense_dtype) for layer in kinds.values()})
    text = json.dumps(
        [PROBE_VERSION, describe_cpu(), ops.int_dot_level(), kernels_key(), torch.__version__,
         torch.get_num_threads(), dense, sorted(kinds)]
    )  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def probe(kinds: dict[str, QuantizedLinear]) -> dict:
    """Per kind: whether int8 wins at decode, and from which rows dense wins (None: never)."""
    return {"kinds": {kind: probe_layer(layer) for kind, layer in kinds.items()}}


def probe_layer(layer: QuantizedLinear) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows = (*DECODE_ROWS, *PREFILL_ROWS)
    xs = {m: torch.randn(m, layer.in_features, generator=gen) for m in rows}
    kernel_layers = {False: layer, True: int8_twin(layer)}
    per_row = {}
    for int8 in (False, True):
        calls = (partial(_kernel, kernel_layers[int8], xs[m], int8) for m in DECODE_ROWS)
        times = best_times(*calls, repeats=PROBE_REPEATS, clock=time.process_time)
        per_row[int8] = sum(t / m for t, m in zip(times, DECODE_ROWS)) / len(DECODE_ROWS)
    int8 = per_row[True] <= INT8_WIN * per_row[False]
    calls: list[Callable[[], torch.Tensor]] = []
    for m in PREFILL_ROWS:
        kernel = partial(_kernel, kernel_layers[int8], xs[m], int8)
        calls += [kernel, partial(layer._dense_matmul, xs[m])]
    times = best_times(*calls, repeats=PROBE_REPEATS, clock=time.process_time)
    kernel_s, dense_s = times[0::2], times[1::2]
    return {
        "int8": int8,
        "dense_min_rows": dense_crossover(kernel_s, dense_s, PREFILL_ROWS),
        "decode_s_per_row": {"fp32": per_row[False], "int8": per_row[True]},
        "prefill_s": {"rows": list(PREFILL_ROWS), "kernel": kernel_s, "dense": dense_s},
    }


def dense_crossover(
    kernel_s: list[float], dense_s: list[float], rows: tuple[int, int]
) -> int | None:
    """The row count from which dense (intercept + slope * rows) beats the kernel (linear in
    rows: its time at the larger probe per row); None if the kernel's per-row cost is no more
    than the dense slope."""
    (m0, m1), per_row = rows, kernel_s[1] / rows[1]
    slope = (dense_s[1] - dense_s[0]) / (m1 - m0)
    if per_row <= slope:
        return None
    intercept = dense_s[0] - slope * m0
    return max(MIN_KERNEL_ROWS, math.ceil(intercept / (per_row - slope)))


def int8_twin(layer: QuantizedLinear) -> QuantizedLinear:
    """The layer as int8 activations would run it: a repacked copy of a K-quant layer that
    repack_int8_layers would repack (the file's pages untouched), else the layer itself."""
    if not isinstance(layer, REPACKABLE) or not layer.can_repack():
        return layer
    if isinstance(layer, Int4WeightOnlyLinear):  # a copy of its own row-layout buffers
        twin = copy.copy(layer)
        twin._buffers = dict(layer._buffers)
        twin.repack_rows8()
        return twin
    row_order = layer._buffers["row_order"]
    twin = KQuantLinear(layer._buffers["blocks"], layer.type_name, row_order=row_order)
    twin.repack_rows8(release_file_pages=False)
    return twin


def _kernel(layer: QuantizedLinear, x: torch.Tensor, int8: bool) -> torch.Tensor:
    """The layer's kernel (never its dense path) with fp32 or int8 activations."""
    saved = layer.int8_activations, layer.dequant_min_rows
    layer.int8_activations, layer.dequant_min_rows = int8, None
    try:
        return layer._matmul(x)
    finally:
        layer.int8_activations, layer.dequant_min_rows = saved
