"""The batch-invariant dense matmul (native/csrc/dense_matmul.cpp) against torch's matmul.

SmolLM2-135M's dense shapes (N x K: o 576x576, gate/up 1536x576, down 576x1536, the tied LM
head 49152x576), at M = 1, 2, 4, 8, 16 rows: torch's `F.linear` on the fp32 weight (what an
fp32 layer runs without the flag) beside our kernel on the same weight packed, fp32 and bf16.
As in a decode step each projection has `--layers` distinct copies (the head one), called one
after the other, so weights stream from memory. Per call: microseconds (thread CPU time with
--threads 1, else wall time; median of `--repeats` passes, cases alternating), and the ratio
ours / torch (goal: <= 1.3 at every M). The CPU model and SIMD level head the table.

Run:  python benchmarks/dense_matmul.py [--threads 1] [--rows 1,2,4,8,16]
Prints a table; writes JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from block_matmul import measure  # noqa: E402

from radixserve.model.quant.batch_invariant import dense_matmul, pack_dense_weight  # noqa: E402
from radixserve.native.extension import load_cpu_ops  # noqa: E402
from radixserve.native.machine import describe_cpu  # noqa: E402

SHAPES = {"o": (576, 576), "gate_up": (1536, 576), "down": (576, 1536), "head": (49152, 576)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16", help="activation rows M, comma-separated")
    p.add_argument("--layers", type=int, default=30, help="distinct copies of each projection")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", default=",".join(SHAPES), help="which of " + ",".join(SHAPES))
    p.add_argument("--out", type=Path, default=Path("bench_results/dense_matmul.json"))
    return p.parse_args(argv)


def torch_linear(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def ours(packed: tuple[torch.Tensor, int], x: torch.Tensor) -> torch.Tensor:
    return dense_matmul(x, *packed)


def cases_for(n: int, k: int, copies: int) -> dict:
    gen = torch.Generator().manual_seed(n * k)
    weights = [torch.randn(n, k, generator=gen) / k**0.5 for _ in range(copies)]
    fp32 = torch.float32
    return {
        "torch": (torch_linear, weights, torch.float32),
        "ours": (ours, [(pack_dense_weight(w), n) for w in weights], torch.float32),
        "ours_bf16w": (ours, [(pack_dense_weight(w.bfloat16()), n) for w in weights], fp32),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    machine = f"{describe_cpu()}; kernel build: {ops.simd_level()}; threads={args.threads}"
    rows = [int(m) for m in args.rows.split(",")]
    print(machine)
    print("us per call; ratio = ours / torch (goal <= 1.3)")
    header = f"{'shape':>8}{'N x K':>12}{'M':>4}{'torch':>10}{'ours':>10}{'ours bf16 W':>13}"
    print(f"{header}{'ratio':>8}")
    results = []
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            cases = cases_for(n, k, 1 if name == "head" else args.layers)
            for m in rows:
                sec = measure(cases, m, args.repeats, k)
                ratio = sec["ours"] / sec["torch"]
                us = {f"{c}_us": sec[c] * 1e6 for c in sec}
                cells = "".join(f"{sec[c] * 1e6:>10.1f}" for c in ("torch", "ours"))
                print(
                    f"{name:>8}{f'{n}x{k}':>12}{m:>4}{cells}{us['ours_bf16w_us']:>13.1f}{ratio:>8.2f}"
                )
                results.append({"shape": name, "n": n, "k": k, "m": m, **us, "ratio": ratio})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine, "threads": args.threads, "rows": results}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
