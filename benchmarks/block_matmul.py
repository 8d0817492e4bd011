"""Per-linear cost of GGUF-block matmuls on CPU: torch's int kernels vs the C++ block kernels
with fp32 activations (block_matmul.cpp) and with int8 activations (q8_matmul.cpp), on the row
layout and (Q4_0) repacked 8 rows at a time ("int8 x8", the AVX-512 layout with fp16 scales;
"x8 x" is its speed-up over "blocks int8").

`--shapes smollm2` (default): SmolLM2-135M's (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576 as Q4_1; the tied LM head 576->49152 as the dense fp32 matrix torch's path
multiplies by, and as Q8_0 blocks); `--shapes llama-1b`: Llama-3.2-1B's (qkv 2048->3072,
o 2048->2048, gate_up 2048->16384, down 8192->2048 as Q4_0, head 2048->49152), at
M = 1, 4, 8, 16 rows. As in a decode step, each layer kind has `--layers`
distinct copies (30: one per transformer layer), called one after the other, so the weights
stream from memory instead of sitting in cache. Per call: microseconds (the thread's CPU
time with --threads 1, else wall time; median of `--repeats` passes) and GB/s = bytes of
weights read / time. Backends alternate within each repetition, so drift on a shared
machine hits both alike.

Run:  OMP_NUM_THREADS=1 python benchmarks/block_matmul.py [--threads 1]
Prints a table; writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from radixserve.model.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

SHAPE_SETS = {
    "smollm2": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)},
    "llama-1b": {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384),
                 "down": (8192, 2048)},
}  # fmt: skip
HEADS = {"smollm2": (576, 49152), "llama-1b": (2048, 49152)}
BACKENDS = ("torch", "blocks", "int8", "x8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,8,16", help="activation rows M, comma-separated")
    p.add_argument("--layers", type=int, default=30, help="distinct copies of each projection")
    p.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="smollm2")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench_results/block_matmul.json"))
    return p.parse_args(argv)


def int4_layers(k: int, n: int, count: int, backend: str) -> list[Int4WeightOnlyLinear]:
    """Q4_0 blocks as the loader holds them (fp16 scales, zero 0); backend "x8": "blocks"
    repacked 8 rows at a time (what int8 activations run on AVX-512)."""
    gen = torch.Generator().manual_seed(k * n)
    layers = []
    for _ in range(count):
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
        zeros = torch.zeros(n, k // 32)
        kernel = "blocks" if backend == "x8" else backend
        layer = Int4WeightOnlyLinear(codes, scales, zeros, 32, backend=kernel)
        if backend == "torch":
            layer.set_compute_dtype(torch.bfloat16)  # what --dtype auto runs
        if backend == "x8":
            layer.repack_rows8()
        layers.append(layer)
    return layers


def head_q8(k: int, n: int) -> Int8WeightOnlyLinear:
    qs = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return Int8WeightOnlyLinear(qs, torch.rand(n, k // 32) * 0.01, group_size=32, backend="blocks")


def with_int8_activations(layers: list) -> list:
    """The same block layers' kernel with int8 activations (a flag: no copy of the weights
    would do, so these are the very layers, called with the flag set around the call)."""
    return [Int8Activations(layer) for layer in layers]


class Int8Activations:
    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        self.layer.int8_activations = True
        try:
            return self.layer(x)
        finally:
            self.layer.int8_activations = False


def weight_bytes(layer: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in layer.buffers() if b is not None)


def time_pass(fn, x: torch.Tensor, layers: list) -> float:
    """Seconds per call over one pass through all `layers`: CPU time of this thread with one
    torch thread (all the work runs on it; time descheduled on a shared machine does not
    count), else wall time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    for layer in layers:
        fn(layer, x)
    return (clock() - start) / len(layers)


def measure(cases: dict, m: int, repeats: int, k: int) -> dict[str, float]:
    """Median seconds per call of each case (name -> (fn, layers, x dtype)), alternating."""
    x = torch.randn(m, k)
    inputs = {name: x.to(dtype) for name, (_, _, dtype) in cases.items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats + 1):  # the first pass warms up
        for name, (fn, layers, _) in cases.items():
            times[name].append(time_pass(fn, inputs[name], layers))
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def call(layer, x):
    return layer(x)


def dense(weight, x):
    return x @ weight.t()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    results = []
    from radixserve.native.extension import load_cpu_ops
    from radixserve.native.machine import describe_cpu

    ops = load_cpu_ops()
    machine = f"{describe_cpu()}; build {ops.simd_level()}, int dot {ops.int_dot_level()}"
    print(f"{machine}; threads={args.threads} layers={args.layers}")
    print("us per call (GB/s of weights read); speedups over torch's int kernels")
    columns = "".join(f"{c:>20}" for c in ("torch", "blocks fp32", "blocks int8", "int8 x8"))
    print(f"{'layer':>8}{'K->N':>12}{'M':>4}{columns}{'fp32 x':>8}{'int8 x':>8}{'x8 x':>8}")
    with torch.inference_mode():
        for name, (k, n) in SHAPE_SETS[args.shapes].items():
            torch_layers = int4_layers(k, n, args.layers, "torch")
            block_layers = int4_layers(k, n, args.layers, "blocks")
            cases = {
                "torch": (call, torch_layers, torch.bfloat16),
                "blocks": (call, block_layers, torch.float32),
                "int8": (call, with_int8_activations(block_layers), torch.float32),
            }
            block_bytes = weight_bytes(block_layers[0])
            byts = {
                "torch": weight_bytes(torch_layers[0]),
                "blocks": block_bytes,
                "int8": block_bytes,
            }
            if block_layers[0].can_repack():  # a build without the 8-row layout: no x8 column
                x8_layers = int4_layers(k, n, args.layers, "x8")
                cases["x8"] = (call, with_int8_activations(x8_layers), torch.float32)
                byts["x8"] = weight_bytes(x8_layers[0])
            results += report(name, k, n, rows, cases, byts, args.repeats)
        k, n = HEADS[args.shapes]
        fp32 = torch.randn(n, k)
        q8 = head_q8(k, n)
        cases = {
            "torch": (dense, [fp32], torch.float32),
            "blocks": (call, [q8], torch.float32),
            "int8": (call, with_int8_activations([q8]), torch.float32),
        }
        byts = {"torch": fp32.numel() * 4, "blocks": weight_bytes(q8), "int8": weight_bytes(q8)}
        results += report("head", k, n, rows, cases, byts, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine, "threads": args.threads, "rows": results}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


def report(name, k, n, rows, cases, byts, repeats) -> list[dict]:
    """Measures every M for one layer kind; prints and returns its rows."""
    out = []
    for m in rows:
        sec = measure(cases, m, repeats, k)
        cells = "".join(
            f"{sec[c] * 1e6:>12.1f} ({byts[c] / sec[c] / 1e9:>5.1f})" if c in sec else f"{'-':>20}"
            for c in BACKENDS
        )
        ratios = f"{sec['torch'] / sec['blocks']:>7.2f}x{sec['torch'] / sec['int8']:>7.2f}x"
        ratios += f"{sec['int8'] / sec['x8']:>7.2f}x" if "x8" in sec else ""
        print(f"{name:>8}{f'{k}->{n}':>12}{m:>4}{cells}{ratios}")
        us = {f"{c}_us": sec[c] * 1e6 for c in sec}
        gbs = {f"{c}_gb_s": byts[c] / sec[c] / 1e9 for c in sec}
        out.append({"layer": name, "k": k, "n": n, "m": m, **us, **gbs, "bytes": byts})
    return out


if __name__ == "__main__":
    main()
