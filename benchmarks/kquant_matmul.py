"""GGUF K-quant matmuls on CPU, fp32 activations (native/csrc/kquant_matmul.cpp) and int8
activations (q8_matmul.cpp; as the file's rows, and Q4_K / Q6_K repacked 8 rows at a time as
serving runs them on AVX-512: "x8"), against torch's F.linear on the dequantized fp32 weight,
at a Llama-3.2-1B shape.

Shapes (K -> N): attention 2048 -> 2048, MLP 2048 -> 8192 and 8192 -> 2048 in Q4_K and Q6_K
(a Q4_K_M file's two projection types), and the LM head 2048 -> 49152 in Q6_K (what
llama-quantize writes for realistic_gguf.py's files, SmolLM2's vocabulary), at M = 1, 4, 16.
As in a decode step, each case has as many distinct
copies of its weight as fill `--stream-mb` (default 600 MB: past this machine's L3, so weights
stream from memory; the bigger fp32 copies need fewer), called one after the other. Per call:
microseconds (thread CPU time with --threads 1, else wall time; median of `--repeats` passes,
cases alternating) and GB/s = bytes of weight read / time. The CPU and the build's SIMD path
head the table.

Run:  python benchmarks/kquant_matmul.py [--threads 1] [--rows 1,4,16]
Prints a table; writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from block_matmul import measure  # noqa: E402

from radixserve.model.quant.kquant import KQUANT_TYPES, KQuantLinear  # noqa: E402
from radixserve.native.extension import load_cpu_ops  # noqa: E402
from radixserve.native.machine import describe_cpu  # noqa: E402

CASES = [  # (name, K, N, GGUF type)
    ("attn", 2048, 2048, "Q4_K"),
    ("mlp", 2048, 8192, "Q4_K"),
    ("attn", 2048, 2048, "Q6_K"),
    ("mlp", 2048, 8192, "Q6_K"),
    ("down", 8192, 2048, "Q4_K"),
    ("down", 8192, 2048, "Q6_K"),
    ("head", 2048, 49152, "Q6_K"),
]


CASE_NAMES = ("torch", "kquant", "int8", "int8_x8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,16", help="activation rows M, comma-separated")
    p.add_argument("--stream-mb", type=float, default=600, help="weight bytes per case")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", default="", help="case indices to run, e.g. 0,1 (default all)")
    p.add_argument("--out", type=Path, default=Path("bench_results/kquant_matmul.json"))
    return p.parse_args(argv)


def kquant_blocks(n: int, k: int, type_name: str, rng: np.random.Generator) -> torch.Tensor:
    """Random super-blocks with finite fp16 scales (the kernel's time does not depend on the
    values)."""
    _, size = KQUANT_TYPES[type_name]
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    halves = np.full((n, k // 256, 2), 0.01, dtype=np.float16).view(np.uint8)
    if type_name == "Q6_K":
        blocks[..., 208:210] = halves[..., :2]
    else:
        blocks[..., 0:4] = halves.reshape(n, k // 256, 4)
    return torch.from_numpy(blocks.reshape(n, -1))


def copies_for(num_bytes: int, stream_mb: float) -> int:
    return max(1, math.ceil(stream_mb * 1e6 / num_bytes))


def call(layer, x):
    return layer(x)


def dense(weight, x):
    return F.linear(x, weight)


def run_case(k: int, n: int, type_name: str, rows: list[int], args) -> list[dict]:
    rng = np.random.default_rng(k * n)
    block_bytes = n * k // 256 * KQUANT_TYPES[type_name][1]
    layers = [
        KQuantLinear(kquant_blocks(n, k, type_name, rng), type_name)
        for _ in range(copies_for(block_bytes, args.stream_mb))
    ]
    int8 = [KQuantLinear(layer.blocks, type_name) for layer in layers]  # the same bytes
    for layer in layers + int8:
        layer.dequant_min_rows = None  # the kernel at every M (decode)
    x8 = [KQuantLinear(layer.blocks, type_name) for layer in layers]
    for layer in int8 + x8:
        layer.int8_activations = True
        layer.dequant_min_rows = None
    for layer in x8:  # rows 8 at a time where this build runs them (else as int8)
        if layer.can_repack():
            layer.repack_rows8()
    fp32 = [torch.randn(n, k) for _ in range(copies_for(n * k * 4, args.stream_mb))]
    cases = {
        "torch": (dense, fp32, torch.float32),
        "kquant": (call, layers, torch.float32),
        "int8": (call, int8, torch.float32),
        "int8_x8": (call, x8, torch.float32),
    }
    byts = {"torch": n * k * 4, "kquant": block_bytes, "int8": block_bytes, "int8_x8": block_bytes}
    results = []
    for m in rows:
        sec = measure(cases, m, args.repeats, k)
        results.append({c: (sec[c] * 1e6, byts[c] / sec[c] / 1e9) for c in cases} | {"m": m})
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    rows = [int(m) for m in args.rows.split(",")]
    picked = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    build = f"{ops.simd_level()}, int dot {ops.int_dot_level()}"
    machine = f"{describe_cpu()}; kernel build: {build}; threads={args.threads}"
    print(machine)
    print("us per call (GB/s of weight read); speedups over torch fp32")
    header = f"{'layer':>6}{'K->N':>13}{'type':>6}{'M':>4}"
    columns = f"{'torch fp32':>22}{'kquant fp32':>22}{'kquant int8':>22}{'int8 x8 rows':>22}"
    print(f"{header}{columns}{'fp32 x':>8}{'int8 x':>8}{'x8 x':>8}")
    out = []
    with torch.inference_mode():
        for name, k, n, type_name in picked:
            for r in run_case(k, n, type_name, rows, args):
                t_us, q_us, i_us, x_us = (r[c][0] for c in CASE_NAMES)
                cells = "".join(f"{r[c][0]:>14.1f} ({r[c][1]:>5.1f})" for c in CASE_NAMES)
                label = f"{name:>6}{f'{k}->{n}':>13}{type_name:>6}{r['m']:>4}"
                speedups = f"{t_us / q_us:>7.2f}x{t_us / i_us:>7.2f}x{t_us / x_us:>7.2f}x"
                print(f"{label}{cells}{speedups}")
                keys = {"layer": name, "k": k, "n": n, "type": type_name, "m": r["m"]}
                times = {f"{c}_us": r[c][0] for c in CASE_NAMES}
                out.append(keys | times | {f"{c}_gb_s": r[c][1] for c in CASE_NAMES})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": out}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
